"""A population with whole-run fusion (docs/design.md §8 and §9): every member in one
multi-epoch dispatch, bitwise equal to the same population unfused, with per-member early
stopping, plateaus and guards on the device, and host handlers that split where they fire.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import tree_equal
from fuseloop.engine import auto_chunk

BATCHES = 4  # 64 examples, batch 16
RATES = [0.0, 0.3, 1.0, 3.0, 10.0]  # measured: members stop at epochs 2, 3 and 11, or run on
EPOCHS = 12


def _data() -> Any:
    rng = np.random.RandomState(0)
    x = rng.rand(64, 6).astype(np.float32)
    y = (x.sum(axis=1) > 3).astype(np.int32)
    return fl.data.arrays(x, y, batch_size=16, device=True, seed=1)


def _trainer(**kw: Any) -> fl.Loop:
    return fl.trainer(
        fl.models.mlp([8, 2]), "sparse_categorical_cross_entropy", "sgd", seed=0, **kw
    )


def _monitored(loop: fl.Loop, restore_best: bool = True) -> fl.Loop:
    return loop.reduce_lr_on_plateau("loss", factor=0.5, patience=1, min_delta=0.002).early_stop(
        "loss", patience=2, min_delta=0.005, restore_best=restore_best
    )


def _same(a: Any, b: Any) -> bool:
    """Equal values, arrays compared bitwise (NaN where the other has NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (np.ndarray, np.generic, float)):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    return a == b


def _assert_same_run(fused: fl.State, plain: fl.State) -> None:
    assert tree_equal(fused.step_state, plain.step_state)
    assert _same(fused.history, plain.history)
    assert _same(fused.metrics, plain.metrics)
    assert _same(fused.handler_metadata, plain.handler_metadata)
    assert fused.event_counts == plain.event_counts
    assert (fused.epoch, fused.status) == (plain.epoch, plain.status)
    for i in range(fused.population):
        a, b = fused.member(i), plain.member(i)
        assert tree_equal(a.step_state, b.step_state)
        assert _same(a.history, b.history) and _same(a.metrics, b.metrics)
        assert _same(a.handler_metadata, b.handler_metadata)
        assert (a.epoch, a.status) == (b.epoch, b.status)


def _stopped(state: fl.State) -> list[Any]:
    return state.handler_metadata["early_stop:loss"]["stopped_epoch"]


# ----------------------------------------------------------------- monitors per member
def test_monitors_per_member_in_one_dispatch(tmp_path):
    runs = {}
    for fuse in (False, "run"):
        stream = io.StringIO()
        loop = (
            _monitored(_trainer(log=3, log_stream=stream))
            .csv_log(str(tmp_path / f"{fuse}.csv"))
            .checkpoint(str(tmp_path / f"{fuse}"), criteria="loss", keep=2)
        )
        state = loop.run(_data(), epochs=EPOCHS, fuse=fuse, population={"learning_rate": RATES})
        runs[fuse] = (state, stream.getvalue(), (tmp_path / f"{fuse}.csv").read_text(), loop)
    fused, plain = runs["run"][0], runs[False][0]
    _assert_same_run(fused, plain)
    assert runs["run"][1] == runs[False][1] and runs["run"][2] == runs[False][2]
    assert fused.stats["dispatches"] == 1 and fused.stats["dispatch_splits"] == {}
    # Each member's best states are kept on the device and written after the dispatch
    # (with keep=2, improvements that later ones prune are numbered, not written).
    _assert_same_saves(tmp_path / "run", tmp_path / "False", len(RATES))
    assert len(_saves(tmp_path / "run" / "member_1")) == 2
    # The members halt at different epochs (each history ends at its own), and their
    # plateaus lower their own rates a different number of times.
    assert _stopped(fused) == [2, None, None, 3, 11]
    record = fused.handler_metadata["_population"]
    assert record["halted"] == [True, False, False, True, True]
    assert [max(fused.member(i).history) for i in range(5)] == [2, 11, 11, 3, 11]
    assert fused.handler_metadata["reduce_lr_on_plateau:loss"]["reductions"] == [0, 1, 2, 1, 4]
    # restore_best: member 3 stopped at epoch 3 and holds its best epoch's step state.
    best = fused.handler_metadata["early_stop:loss"]["best_epoch"][3]
    assert best < 3 and int(fused.member(3).step_state["step"]) == (best + 1) * BATCHES
    again = runs["run"][3].run(
        _data(), epochs=EPOCHS, fuse="run", population={"learning_rate": RATES}
    )
    assert again.stats["compiles"] == 0
    _assert_same_run(again, fused)


def test_fuse_k_beyond_the_epoch_and_resume(tmp_path):
    population = {"learning_rate": RATES}
    loop = _monitored(_trainer(), restore_best=False)
    whole = loop.run(_data(), epochs=8, fuse="run", population=population)
    half = loop.run(_data(), epochs=3, fuse="run", population=population)
    fl.save_state(half, tmp_path / "half")
    loaded = fl.load_state(tmp_path / "half")
    plain = loop.run(_data(), loaded, epochs=8, fuse=False)
    fused = loop.run(_data(), loaded, epochs=8, fuse=2 * BATCHES + 1)
    _assert_same_run(fused, plain)
    assert tree_equal(fused.step_state, whole.step_state)
    assert _same(fused.history, whole.history)
    assert fused.stats["dispatches"] == -(-(8 - 3) * BATCHES // (2 * BATCHES + 1))
    assert _stopped(fused) == [2, None, None, 3, None]  # member 0 stopped before the resume


def test_an_iteration_observer_sees_each_members_metrics_as_unfused():
    """The records of every step are kept (and read) only where an iteration handler
    replays them; the observer sees the same per-member metrics as unfused, in one dispatch.
    """
    seen: dict[Any, list[Any]] = {False: [], "run": []}
    for fuse in seen:
        loop = _monitored(_trainer(), restore_best=False).observe(
            "iteration_completed",
            lambda state, fuse=fuse: seen[fuse].append((state.iteration, state.metrics["loss"])),
        )
        state = loop.run(_data(), epochs=5, fuse=fuse, population={"learning_rate": RATES})
    assert len(seen["run"]) == 5 * BATCHES
    assert _same(seen["run"], seen[False])
    assert state.stats["dispatches"] == 1


# ----------------------------------------------------------------- halts
def test_terminate_on_nan_freezes_one_member():
    loop = _trainer().terminate_on_nan()
    population = {"learning_rate": [0.3, 1e30]}
    states = {}
    for fuse in (False, "run"):
        with pytest.warns(RuntimeWarning, match=r"members \[1\]"):
            states[fuse] = loop.run(_data(), epochs=4, fuse=fuse, population=population)
    fused = states["run"]
    _assert_same_run(fused, states[False])
    assert fused.handler_metadata["_population"]["halted"] == [False, True]
    assert fused.status == "completed" and sorted(fused.member(0).history) == [0, 1, 2, 3]
    assert fused.member(1).history == {} and fused.stats["dispatches"] == 1
    every = {}
    for fuse in (False, "run"):  # every member trips: the run halts in its first epoch
        with pytest.warns(RuntimeWarning):
            every[fuse] = loop.run(
                _data(),
                epochs=4,
                fuse=fuse,
                population={"seed": [0, 1]} | {"learning_rate": [1e30, 1e30]},
            )
    _assert_same_run(every["run"], every[False])
    assert every["run"].status == "halted" and every["run"].history == {}


def test_a_host_halt_stops_every_member_at_its_epoch():
    def halt_at_4(state):
        return "halt_loop" if state.epoch == 4 else None

    def loop() -> fl.Loop:
        monitored = _trainer().early_stop("loss", patience=1, restore_best=True)
        return monitored.handle_event("epoch_completed", halt_at_4, filter={"every": 2})

    population = {"learning_rate": RATES}
    plain = loop().run(_data(), epochs=EPOCHS, fuse=False, population=population)
    fused = loop().run(_data(), epochs=EPOCHS, fuse="run", population=population)
    _assert_same_run(fused, plain)
    # The handler fires at epochs 0, 2 and 4 (each ends a dispatch) and halts at 4; the
    # members early stopping halted inside a dispatch (1, 2, 3) stay halted at their epochs.
    assert sorted(fused.history) == [0, 1, 2, 3, 4] and fused.status == "halted"
    assert sorted(fused.stats["dispatch_splits"]) == [0, 2, 4]
    assert fused.stats["dispatches"] == 3
    assert fused.handler_metadata["_population"]["last_epoch"] == [1, None, 3, 2, 2]
    assert all(fused.member(i).status == "halted" for i in range(5))


# ----------------------------------------------------------------- checkpoints
def _saves(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("checkpoint_"))


def _assert_same_saves(fused: Path, plain: Path, members: int) -> None:
    for i in range(members):
        a, b = fused / f"member_{i}", plain / f"member_{i}"
        assert _saves(a) and _saves(a) == _saves(b)
        for name in _saves(a):
            x, y = fl.load_state(str(a / name)), fl.load_state(str(b / name))
            assert tree_equal(x.step_state, y.step_state)
            assert _same(x.history, y.history) and _same(x.handler_metadata, y.handler_metadata)
            assert (x.epoch, x.status) == (y.epoch, y.status)


def test_a_best_checkpoint_before_the_plateau_saves_each_members_rate_before_its_cut(tmp_path):
    # An epoch handler after them makes every epoch the last of its dispatch, fired live
    # with the carry, which the device's plateau had cut already: each member's save held
    # the lowered rate where the unfused save holds the rate before the cut. The plateau's
    # min_delta makes an epoch that improves the loss a little both save and cut.
    runs = {}
    for fuse in (False, "run"):
        loop = (
            _trainer()
            .checkpoint(str(tmp_path / f"{fuse}"), criteria="loss")
            .reduce_lr_on_plateau("loss", factor=0.5, patience=0, min_delta=0.05)
            .handle_event("epoch_completed", lambda s: None)
        )
        runs[fuse] = loop.run(_data(), epochs=4, fuse=fuse, population={"learning_rate": RATES})
    _assert_same_run(runs["run"], runs[False])
    _assert_same_saves(tmp_path / "run", tmp_path / "False", len(RATES))
    cuts = runs[False].handler_metadata["reduce_lr_on_plateau:loss"]["reductions"]
    assert any(cuts) and runs["run"].stats["dispatches"] == 4


# ----------------------------------------------------------------- validation
def _validation(drop_remainder: bool) -> Any:
    rng = np.random.RandomState(3)
    vx = rng.rand(40, 6).astype(np.float32)  # 2 whole batches and a short one of 8
    y = (vx.sum(axis=1) > 3).astype(np.int32)
    return fl.data.arrays(vx, y, batch_size=16, device=True, drop_remainder=drop_remainder)


def test_validation_and_early_stop_on_it_run_on_the_device():
    val = _validation(drop_remainder=False)  # the short batch: a step of its own shape

    def loop() -> fl.Loop:
        model = fl.models.mlp([8, 2])
        return (
            fl.trainer(model, "sparse_categorical_cross_entropy", "sgd", seed=0)
            .metric("accuracy")
            .validate(model, val)
            .early_stop("validation_loss", patience=2, restore_best=True)
        )

    population = {"learning_rate": RATES}
    plain = loop().run(_data(), epochs=EPOCHS, fuse=False, population=population)
    fused = loop().run(_data(), epochs=EPOCHS, fuse="run", population=population)
    _assert_same_run(fused, plain)
    assert fused.stats["dispatches"] == 1 and fused.stats["dispatch_splits"] == {}
    assert fused.metrics["validation_loss"].shape == (5,)
    stopped = [e for e in fused.handler_metadata["early_stop:validation_loss"]["stopped_epoch"]]
    assert len({e for e in stopped if e is not None}) >= 2  # members stop at different epochs


def test_device_validation_drops_the_short_batch_the_evaluator_drops():
    # A solo run: the device's validation runs the batches the evaluator runs.
    model = fl.models.mlp([8, 2])
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", "sgd", seed=0).validate(
        model, _validation(drop_remainder=True)
    )
    plain = loop.run(_data(), epochs=2, fuse=False)
    fused = loop.run(_data(), epochs=2, fuse="run")
    assert tree_equal(fused.step_state, plain.step_state)
    assert fused.history == plain.history and fused.stats["dispatches"] == 1


def test_auto_crosses_epochs_for_a_population(monkeypatch):
    # The probe measures a dispatch overhead worth 1000 steps: the whole run in one.
    overhead = 1000 * auto_chunk.DEFAULT_TOLERANCE * 1e-4
    monkeypatch.setattr(auto_chunk, "_timings", lambda *args: (1e-4, overhead))
    # The loop and population test_fuse_k_beyond_the_epoch_and_resume runs (its programs).
    loop = _monitored(_trainer(), restore_best=False)
    population = {"learning_rate": RATES}
    plain = loop.run(_data(), epochs=3, fuse=False, population=population)
    fused = loop.run(_data(), epochs=3, fuse="auto", population=population)
    _assert_same_run(fused, plain)
    assert fused.stats["whole_run"] == "many epochs per dispatch"
    assert fused.stats["dispatches"] == 1


def test_restore_best_keeps_the_best_epochs_rate_when_a_later_plateau_reduces_it():
    """`early_stop(restore_best=True)` attached before `reduce_lr_on_plateau`: when a
    member's best epoch is also the epoch the plateau reduces its rate, the copy is the
    step state before the reduction (as the unfused run's handler copies it), also for the
    epoch a dispatch ends on, which the host handler fires live after the device reduced."""
    rng = np.random.RandomState(0)
    x = rng.randn(256, 8).astype(np.float32)
    y = np.abs(x[:, :3]).argmax(1).astype(np.int32)

    def init(key: Any, xs: Any) -> Any:
        return {"w": jax.random.normal(key, (8, 3)) * 0.3}

    def apply(params: Any, xs: Any, train: bool = False, rng: Any = None) -> Any:
        if train:
            xs = jnp.where(jax.random.bernoulli(rng, 0.8, xs.shape), xs / 0.8, 0)
        return xs @ params["w"]

    model = (init, apply)
    states = {}
    for fuse in (False, "run"):
        train = fl.data.arrays(x[:192], y[:192], batch_size=16, seed=1, device=True)
        val = fl.data.arrays(x[192:], y[192:], 16, shuffle=False, drop_remainder=False, device=True)
        loop = (
            fl.trainer(model, "sparse_categorical_cross_entropy", "adam")
            .validate(model, val)
            .early_stop("validation_loss", patience=1, restore_best=True)
            .reduce_lr_on_plateau("loss", patience=1)
        )
        states[fuse] = loop.run(train, epochs=4, fuse=fuse, population=3)
    plain, fused = states[False], states["run"]
    stop = plain.handler_metadata["early_stop:validation_loss"]
    plateau = plain.handler_metadata["reduce_lr_on_plateau:loss"]
    last_rates = np.asarray(plain.history[3]["learning_rate"])
    # The case this test is about: a member whose best is the last epoch, which reduced it.
    assert any(
        best == 3 and rate > 0 and n == 2
        for best, rate, n in zip(stop["best_epoch"], last_rates, plateau["reductions"], strict=True)
    ), (stop, plateau)
    _assert_same_run(fused, plain)
