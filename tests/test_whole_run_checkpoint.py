"""Whole-run fusion with `checkpoint(criteria=...)` (docs/design.md §9): the best states are
kept on the device and written at the dispatch's end, so the dispatch does not split, and
every save on disk holds what the unfused run's save holds.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import fuseloop as fl
from fuseloop.engine import device_checkpoint
from test_whole_run import _assert_same_run, _data, _same_tree, _trainer, _validated

EPOCHS = 8


def _saves(path: Path) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.startswith("checkpoint_"))


def _assert_same_saves(fused_dir: Path, plain_dir: Path) -> None:
    names = _saves(plain_dir)
    assert names and _saves(fused_dir) == names
    for name in names:
        a, b = fl.load_state(str(fused_dir / name)), fl.load_state(str(plain_dir / name))
        assert _same_tree(a.step_state, b.step_state), name
        assert (a.epoch, a.iteration, a.status) == (b.epoch, b.iteration, b.status)
        assert a.history == b.history and a.metrics == b.metrics
        assert a.handler_metadata == b.handler_metadata
        assert a.event_counts == b.event_counts


@functools.cache
def _base() -> fl.Loop:
    """One `_trainer()` Loop for the runs here that need no fresh program cache: a
    checkpoint is a handler, so every `_base().checkpoint(...)` shares its programs (traced
    and lowered once; a shorter whole-run dispatch may take a longer program compiled
    already, as any reused Loop does)."""
    return _trainer()


def _on_loss(path: Path, keep: int | None = None, fresh: bool = False) -> fl.Loop:
    """A best-loss checkpoint into `path`; `fresh`: on a Loop of its own (its compiles
    counted), else on `_base()`."""
    return (_trainer() if fresh else _base()).checkpoint(str(path), criteria="loss", keep=keep)


@pytest.mark.parametrize("keep", [None, 1, 3])
def test_best_checkpoint_does_not_split_and_writes_the_same_saves(tmp_path, keep):
    plain = _on_loss(tmp_path / "a", keep).run(_data(), epochs=EPOCHS)
    loop = _on_loss(tmp_path / "b", keep, fresh=True)  # its own: a second run compiles nothing
    fused = loop.run(_data(), epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    _assert_same_saves(tmp_path / "b", tmp_path / "a")
    assert len(_saves(tmp_path / "a")) == (keep or EPOCHS)  # the loss improved every epoch
    assert fused.stats["dispatches"] == 1
    assert fused.stats["dispatch_splits"] == {}
    again = loop.run(_data(), epochs=EPOCHS, fuse="run")
    assert again.stats["compiles"] == 0


def test_best_checkpoint_with_validation_early_stop_and_k_beyond_the_epoch(tmp_path):
    validated = _validated(patience=3)  # one Loop for both runs: traced once

    def loop(path: Path) -> fl.Loop:
        return validated.checkpoint(str(path), criteria="validation_loss", keep=2)

    plain = loop(tmp_path / "a").run(_data(), epochs=40)
    fused = loop(tmp_path / "b").run(_data(), epochs=40, fuse=2 * 6 + 3)
    _assert_same_run(fused, plain)
    _assert_same_saves(tmp_path / "b", tmp_path / "a")
    assert fused.status == "halted"
    assert fused.stats["dispatch_splits"] == {}


def test_a_full_ring_ends_the_dispatch_and_loses_no_save(tmp_path, monkeypatch):
    # 4 epochs, every one an improvement: each dispatch after the first has fewer epochs
    # left, so each compiles a whole-run program of its own (8 epochs took twice as long).
    epochs = 4
    plain = _on_loss(tmp_path / "a").run(_data(), epochs=epochs)
    # A ring of one state (as for a model too large to keep more): each improvement ends
    # the dispatch after its epoch, and is written from the live state.
    monkeypatch.setattr(device_checkpoint, "RING_BUDGET_BYTES", 1)
    fused = _on_loss(tmp_path / "b").run(_data(), epochs=epochs, fuse="run")
    _assert_same_run(fused, plain)
    _assert_same_saves(tmp_path / "b", tmp_path / "a")
    assert len(_saves(tmp_path / "a")) == epochs  # the loss improved every epoch
    assert fused.stats["dispatches"] == epochs
    assert fused.stats["dispatch_splits"] == {}


def test_periodic_checkpoint_still_splits_where_it_fires(tmp_path):
    def loop(path: Path) -> fl.Loop:
        return (
            _base()
            .checkpoint(str(path / "best"), criteria="loss", keep=1)
            .checkpoint(str(path / "every"), filter={"every": 3})
        )

    plain = loop(tmp_path / "a").run(_data(), epochs=EPOCHS)
    fused = loop(tmp_path / "b").run(_data(), epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    for kind in ("best", "every"):
        _assert_same_saves(tmp_path / "b" / kind, tmp_path / "a" / kind)
    assert sorted(fused.stats["dispatch_splits"]) == [0, 3, 6]
    assert all("checkpoint" in why for why in fused.stats["dispatch_splits"].values())


def test_resumed_from_a_best_checkpoint(tmp_path):
    first = _on_loss(tmp_path / "c").run(_data(), epochs=3, fuse="run")
    saved = fl.load_state(str(tmp_path / "c"))
    assert saved.epoch == first.epoch == 2
    plain = _on_loss(tmp_path / "a").run(_data(), saved, epochs=EPOCHS)
    fused = _on_loss(tmp_path / "b").run(_data(), saved, epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    _assert_same_saves(tmp_path / "b", tmp_path / "a")
    whole = _base().run(_data(), epochs=EPOCHS)
    assert _same_tree(fused.step_state, whole.step_state)


def test_plateau_before_the_best_checkpoint_is_in_its_saves(tmp_path):
    vx = np.random.default_rng(5).normal(size=(48, 5)).astype(np.float32)
    vy = np.random.default_rng(6).integers(0, 3, 48).astype(np.int32)
    model = fl.models.mlp([8, 3])
    val = fl.data.arrays(vx, vy, batch_size=16, device=True)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3)

    on_plateau = (  # one Loop for both runs: traced once
        fl.trainer(model, "sparse_categorical_cross_entropy", tx)
        .validate(model, val)
        .reduce_lr_on_plateau("validation_loss", factor=0.5, patience=1, min_lr=0.02)
    )

    def loop(path: Path) -> fl.Loop:
        return on_plateau.checkpoint(str(path), criteria="loss", keep=2)

    plain = loop(tmp_path / "a").run(_data(), epochs=20)
    fused = loop(tmp_path / "b").run(_data(), epochs=20, fuse="run")
    _assert_same_run(fused, plain)
    _assert_same_saves(tmp_path / "b", tmp_path / "a")
    assert len({h["learning_rate"] for h in plain.history.values()}) >= 2
    assert fused.stats["dispatches"] == 1
    assert jax.tree.leaves(fused.step_state)  # the carry is whole after the saves


@pytest.mark.parametrize("observer", [False, True])
def test_a_best_checkpoint_before_the_plateau_saves_the_rate_before_its_cut(tmp_path, observer):
    # The dispatch's last epoch fires live, with the carry's step state, which the device's
    # plateau (after the checkpoint in the order) had already cut: that epoch's save held
    # the lowered rate where the unfused save holds the rate before the cut. An epoch
    # handler attached after them makes every epoch the last of its dispatch.
    vx = np.random.default_rng(5).normal(size=(48, 5)).astype(np.float32)
    vy = np.random.default_rng(6).integers(0, 3, 48).astype(np.int32)
    model = fl.models.mlp([8, 3])
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3)
    base = fl.trainer(model, "sparse_categorical_cross_entropy", tx).validate(
        model, fl.data.arrays(vx, vy, batch_size=16, device=True)
    )

    def loop(path: Path) -> fl.Loop:
        saving = base.checkpoint(str(path), criteria="loss").reduce_lr_on_plateau(
            "validation_loss", factor=0.5, patience=1, min_lr=0.02
        )
        return saving.handle_event("epoch_completed", lambda s: None) if observer else saving

    reference = loop(tmp_path / "r").run(_data(), epochs=12)
    rates = [reference.history[e]["learning_rate"] for e in sorted(reference.history)]
    saved = {fl.load_state(str(tmp_path / "r" / n)).epoch for n in _saves(tmp_path / "r")}
    cut_at = {e for e in range(len(rates) - 1) if rates[e + 1] < rates[e]}
    both = min(saved & cut_at)  # an epoch both saved and cut: the run's last below
    plain = loop(tmp_path / "a").run(_data(), epochs=both + 1)
    fused = loop(tmp_path / "b").run(_data(), epochs=both + 1, fuse="run")
    _assert_same_run(fused, plain)
    _assert_same_saves(tmp_path / "b", tmp_path / "a")
    assert (fused.stats["dispatches"] > 1) == observer


def test_best_saves_kept_on_the_device_keep_a_python_floats_weak_type(tmp_path):
    # The device ring holds strong copies; a save from it must hold the leaf weak, as the
    # unfused run's save does, or a resume from it promotes differently.
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    source = fl.data.arrays(x, x[:, :1], batch_size=8, seed=0, device=True)

    def init_fn(batch, seed):
        return {"w": jax.numpy.full((4, 1), 0.3, "bfloat16"), "loss": np.float32(0), "lr": 0.01}

    def step_fn(batch, state):
        xb, yb = batch
        loss, g = jax.value_and_grad(lambda w: ((xb @ w.astype("float32") - yb) ** 2).mean())(
            state["w"]
        )
        return {**state, "w": (state["w"] - state["lr"] * g).astype("bfloat16"), "loss": loss}

    loop = fl.loop(step_fn, init_fn).metric("loss").checkpoint(tmp_path, criteria="loss")
    loop.run(source, 0, epochs=4, fuse="run")
    saves = [fl.load_state(str(tmp_path / name)) for name in _saves(tmp_path)]
    assert len(saves) == 4  # three from the device's ring, the last one live
    assert all(save.step_state["lr"].weak_type for save in saves)
