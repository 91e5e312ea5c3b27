"""Whole-run fusion (docs/design.md §9): many epochs per dispatch on device-resident data,
bitwise equal to the unfused run, with handlers that observe replayed in unfused order and
handlers that may halt ending the dispatch at their epoch.
"""

from __future__ import annotations

import functools
import io
import warnings
from typing import Any

import jax
import numpy as np
import optax
import pytest

import fuseloop as fl

EPOCHS = 5
BATCHES = 6  # 96 examples, batch 16


def _xy(seed: int = 0, n: int = 96) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    return x, rng.integers(0, 3, n).astype(np.int32)


def _data(**kw: object) -> object:
    x, y = _xy()
    return fl.data.arrays(x, y, batch_size=16, device=True, seed=1, **kw)


def _trainer(**kw: object) -> fl.Loop:
    model = fl.models.mlp([8, 3])
    return fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-2), **kw).metric(
        "accuracy"
    )


@functools.cache
def _shared_trainer() -> fl.Loop:
    """One `_trainer()` Loop for this file's tests that only run it (a Loop is immutable and
    reusable; sharing it skips re-tracing and lowering its programs). `_trainer()` itself
    stays a fresh Loop: other test files import it."""
    return _trainer()


def _same_tree(a: object, b: object) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def _assert_same_run(fused: fl.State, plain: fl.State) -> None:
    assert _same_tree(fused.step_state, plain.step_state)
    assert fused.history == plain.history
    assert fused.metrics == plain.metrics
    assert fused.event_counts == plain.event_counts
    assert fused.handler_metadata == plain.handler_metadata
    assert (fused.epoch, fused.iteration, fused.status) == (
        plain.epoch,
        plain.iteration,
        plain.status,
    )


def _recorder(events: list) -> fl.Loop:
    loop = _trainer()
    for event in ("epoch_started", "epoch_completed", "completed"):
        loop = loop.observe(
            event, lambda s, e=event: events.append((e, s.epoch, s.iteration, dict(s.metrics)))
        )
    return loop.observe(
        "iteration_completed",
        lambda s: events.append(("it", s.epoch, s.iteration, dict(s.metrics))),
        filter={"every": 4},
    )


@functools.cache
def _unfused_recorded() -> tuple[fl.State, tuple]:
    """The unfused run with its observers' record, run once and shared by every fuse."""
    events: list = []
    return _recorder(events).run(_data(), epochs=EPOCHS, fuse=False), tuple(events)


@functools.cache
def _fused_recorded(fuse: Any) -> tuple[fl.State, tuple]:
    """A fused run with its observers' record, run once per fuse and shared (a State is
    immutable)."""
    events: list = []
    return _recorder(events).run(_data(), epochs=EPOCHS, fuse=fuse), tuple(events)


@pytest.mark.parametrize("fuse", ["run", 4, BATCHES, BATCHES + 1, 2 * BATCHES + 3])
def test_fused_epochs_are_bitwise_the_unfused_run_with_observers_replayed(fuse):
    plain, plain_events = _unfused_recorded()
    fused, fused_events = _fused_recorded(fuse)
    _assert_same_run(fused, plain)
    assert fused_events == plain_events
    if fuse == "run":
        assert fused.stats["dispatches"] == 1
        assert fused.stats["dispatch_splits"] == {}


def _sine(n: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(n, features)).astype(np.float32)
    y = np.sin(np.pi * x[:, :1]) * x[:, 1:2] + (x[:, 2:3] ** 2 if features > 2 else 0)
    return x, y.astype(np.float32)


# Optimizers whose arithmetic XLA:CPU simplified by the step loop's context (docs/design.md
# §9, "Where one loop body is not enough"): optax.polyak_sgd negates the gradient (an
# sgd(1.0)) and takes its step size from the updates' squared global norm; the named "adam"
# reads its rate from its injected hyperparameters. With loop-invariant code motion on in
# the multi-epoch programs only, polyak came out one float32 ulp apart by epoch 6 (the step
# size then amplifies it), and with it off there only, the named adam did.
_CONTEXT_CASES = {
    "polyak": (optax.polyak_sgd(max_learning_rate=1.0), [16, 1], 256, 2, 128, 10, False),
    "named-adam": ("adam", [16, 16, 1], 200, 3, 40, 12, True),
}


@pytest.mark.parametrize("fuse", ["run", 7])
@pytest.mark.parametrize("case", sorted(_CONTEXT_CASES))
def test_an_optimizer_whose_arithmetic_xla_simplifies_by_context_stays_bitwise(case, fuse):
    optimizer, widths, n, features, batch, epochs, shuffle = _CONTEXT_CASES[case]
    x, y = _sine(n, features)
    loop = fl.trainer(fl.models.mlp(widths), "mse", optimizer)

    def run(fuse: Any) -> fl.State:
        data = fl.data.arrays(x, y, batch_size=batch, shuffle=shuffle, seed=3, device=True)
        return loop.run(data, epochs=epochs, fuse=fuse)

    fused = run(fuse)
    assert fused.stats["whole_run"] == "many epochs per dispatch"
    _assert_same_run(fused, run(False))


def test_dispatch_count_follows_k_across_epochs():
    # The runs of the bitwise test above (observers replay and do not split a dispatch).
    steps = EPOCHS * BATCHES
    for k in (BATCHES + 1, 2 * BATCHES + 3):
        state, _ = _fused_recorded(k)
        assert state.stats["dispatches"] == -(-steps // k)
        assert state.stats["dispatch_splits"] == {}


def test_log_bytes_and_csv_files_match_and_do_not_split(tmp_path):
    outputs = {}
    for fuse in (False, "run"):
        stream = io.StringIO()
        path = tmp_path / f"m_{fuse}.csv"
        loop = (
            _trainer(log=4, log_stream=stream)
            .csv_log(str(path))
            .log(
                lambda s: f"e{s.epoch} {s.metrics['loss']:.9f}\n", "epoch_completed", stream=stream
            )
        )
        state = loop.run(_data(), epochs=EPOCHS, fuse=fuse)
        outputs[fuse] = (stream.getvalue(), path.read_text(), state)
    assert outputs[False][0] == outputs["run"][0]
    assert outputs[False][1] == outputs["run"][1]
    assert outputs["run"][2].stats["dispatches"] == 1


def test_observer_must_return_none():
    loop = _trainer().observe("epoch_completed", lambda s: "halt_loop")
    with pytest.raises(ValueError, match="observe"):
        loop.run(_data(), epochs=1, fuse="run")


def test_a_halting_user_handler_halts_at_its_exact_epoch():
    def stop_at_two(state):
        return "halt_loop" if state.epoch == 2 else None

    loop = _trainer().handle_event("epoch_completed", stop_at_two)
    plain = loop.run(_data(), epochs=EPOCHS)
    fused = loop.run(_data(), epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    assert sorted(fused.history) == [0, 1, 2]
    assert fused.stats["dispatches"] == 3  # the handler sees the live State every epoch
    assert "on epoch_completed" in fused.stats["dispatch_splits"][0]


def test_counter_filtered_handler_splits_only_where_it_fires():
    seen = []

    def params_at(state):
        seen.append((state.epoch, np.asarray(jax.tree.leaves(state.params)[0]).copy()))

    loop = _trainer().handle_event("epoch_completed", params_at, filter={"every": 2})
    loop.run(_data(), epochs=EPOCHS)
    plain_seen, seen[:] = list(seen), []
    fused = loop.run(_data(), epochs=EPOCHS, fuse="run")
    assert [e for e, _ in seen] == [0, 2, 4]
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(seen, plain_seen, strict=True))
    assert sorted(fused.stats["dispatch_splits"]) == [0, 2]
    assert fused.stats["dispatches"] == 3


def test_epoch_started_handler_splits_before_its_epoch():
    def mark(state):
        return "continue", state.replace(handler_metadata={"at": state.epoch})

    loop = _trainer().handle_event("epoch_started", mark, filter={"once": 3})
    plain = loop.run(_data(), epochs=EPOCHS)
    fused = loop.run(_data(), epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    assert fused.stats["dispatches"] == 2
    assert list(fused.stats["dispatch_splits"]) == [1]


def test_early_stop_and_checkpoints_every_n_epochs_and_resume(tmp_path):
    def build(path):
        return (
            _trainer()
            .early_stop("loss", patience=1, min_delta=0.5)
            .checkpoint(str(path), filter={"every": 2})
        )

    plain = build(tmp_path / "a").run(_data(), epochs=EPOCHS)
    fused = build(tmp_path / "b").run(_data(), epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    assert fused.status == "halted"
    saved_a = fl.load_state(str(tmp_path / "a"))
    saved_b = fl.load_state(str(tmp_path / "b"))
    assert saved_a.epoch == saved_b.epoch
    assert _same_tree(saved_a.step_state, saved_b.step_state)


def test_resumed_from_a_checkpoint_mid_run(tmp_path):
    first = _trainer().checkpoint(str(tmp_path / "c")).run(_data(), epochs=2, fuse="run")
    saved = fl.load_state(str(tmp_path / "c"))
    assert saved.epoch == first.epoch
    loop = _shared_trainer()
    plain = loop.run(_data(), saved, epochs=EPOCHS)
    fused = loop.run(_data(), saved, epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    assert sorted(fused.history) == list(range(EPOCHS))
    whole = loop.run(_data(), epochs=EPOCHS)
    assert _same_tree(fused.step_state, whole.step_state)


def test_terminate_on_nan_halts_at_the_same_step():
    x, y = _xy()
    x[70] = np.nan  # batch order is shuffled per epoch: the first epoch meets it
    data = lambda: fl.data.arrays(x, y, batch_size=16, device=True, seed=1)  # noqa: E731
    loop = _trainer().terminate_on_nan()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        plain = loop.run(data(), epochs=EPOCHS)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        fused = loop.run(data(), epochs=EPOCHS, fuse="run")
    _assert_same_run(fused, plain)
    assert fused.status == "halted"


def test_a_guard_halt_restores_the_best_epoch_as_the_unfused_run_does():
    x, y = _xy()
    x[37, 2] = np.nan  # one poisoned example: the epoch whose first 2 batches draw it halts
    loop = _trainer().early_stop("loss", mode="max", patience=10, restore_best=True)
    loop = loop.terminate_on_nan()

    def run(fuse: Any) -> fl.State:
        data = fl.data.arrays(x, y, batch_size=16, device=True, seed=10)
        with pytest.warns(RuntimeWarning, match="non-finite") as caught:
            state = loop.run(data, epochs=8, iterations=2, fuse=fuse)
        assert not any("earlier run" in str(w.message) for w in caught)
        return state

    plain = run(False)
    best = plain.handler_metadata["early_stop:loss"]["best_epoch"]
    assert plain.status == "halted" and best < plain.epoch - 1  # best ran dispatches before
    for fuse in (4, "run"):
        fused = run(fuse)
        _assert_same_run(fused, plain)
        assert int(fused.step_state["step"]) == 2 * (best + 1)  # the best epoch's step state


def test_iterations_bound_and_second_run_does_not_recompile():
    loop = _trainer()
    plain = loop.run(_data(), epochs=3, iterations=4)
    fused = loop.run(_data(), epochs=3, iterations=4, fuse="run")
    _assert_same_run(fused, plain)
    again = loop.run(_data(), epochs=3, iterations=4, fuse="run")
    assert again.stats["compiles"] == 0


def test_short_last_batch_and_host_data_keep_epoch_bounded_dispatches():
    x, y = _xy(n=90)  # 5 full batches and a short one
    short = fl.data.arrays(x, y, batch_size=16, device=True, seed=1, drop_remainder=False)
    loop = _shared_trainer()
    plain = loop.run(short, epochs=3)
    fused = loop.run(short, epochs=3, fuse="run")
    _assert_same_run(fused, plain)
    assert "short batch" in fused.stats["whole_run"]
    batches = [(x[i : i + 18], y[i : i + 18]) for i in range(0, 90, 18)]
    host = loop.run(batches, epochs=3, fuse="run")
    assert _same_tree(host.step_state, loop.run(batches, epochs=3).step_state)
    assert host.stats["dispatches"] == 3
    assert "host-fed" in host.stats["whole_run"]


# --------------------------------------------------------------------- device monitors
def _validated(patience: int = 2, restore: bool = True, min_delta: float = 0.0, **val_kw):
    vx, vy = _xy(seed=5, n=48)
    model = fl.models.mlp([8, 3])
    val = fl.data.arrays(vx, vy, batch_size=16, device=True, **val_kw)
    return (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.05))
        .metric("accuracy")
        .validate(model, val)
        .early_stop("validation_loss", patience=patience, restore_best=restore, min_delta=min_delta)
    )


@functools.cache
def _validated_loop(options: tuple) -> fl.Loop:
    """One `_validated` Loop per options, shared by its reference run and every fuse."""
    return _validated(**dict(options))


@functools.cache
def _unfused_validated(options: tuple) -> Any:
    """The unfused reference, run once per options and shared by every fuse (a State is
    immutable)."""
    return _validated_loop(options).run(_data(), epochs=25, fuse=False)


@pytest.mark.parametrize("fuse", ["run", 4, BATCHES + 1, 2 * BATCHES + 3])
@pytest.mark.parametrize(
    "options",
    [{}, {"restore": False}, {"patience": 0}, {"patience": 1, "min_delta": 0.002}],
)
def test_validation_and_early_stop_on_the_device_match_the_host(fuse, options):
    options = tuple(sorted(options.items()))
    plain = _unfused_validated(options)
    fused = _validated_loop(options).run(_data(), epochs=25, fuse=fuse)
    _assert_same_run(fused, plain)
    assert "validation_loss" in fused.history[0]
    if fuse == 4:  # within the epoch: the per-epoch engine, validation on the host
        return
    assert fused.stats["dispatch_splits"] == {}
    if fuse == "run":
        assert fused.stats["dispatches"] == 1


def test_early_stop_halts_late_and_restores_the_best_epoch():
    loop = _validated(patience=3)
    plain = loop.run(_data(), epochs=60, fuse=False)
    fused = loop.run(_data(), epochs=60, fuse="run")
    _assert_same_run(fused, plain)
    record = next(v for k, v in fused.handler_metadata.items() if k.startswith("early_stop"))
    assert fused.status == "halted" and record["stopped_epoch"] >= 3
    assert record["best_epoch"] < record["stopped_epoch"]
    assert fused.stats["dispatches"] == 1


def test_host_fed_validation_splits_the_dispatch_at_each_epoch():
    vx, vy = _xy(seed=5, n=48)
    model = fl.models.mlp([8, 3])
    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.05))
        .validate(model, [(vx[:24], vy[:24]), (vx[24:], vy[24:])])
        .early_stop("validation_loss", patience=2)
    )
    plain = loop.run(_data(), epochs=4)
    fused = loop.run(_data(), epochs=4, fuse="run")
    _assert_same_run(fused, plain)
    assert fused.stats["dispatches"] == len(fused.history)
    assert "validate" in fused.stats["dispatch_splits"][0]


@functools.cache
def _plateau(order: str = "plateau_first") -> fl.Loop:
    """One Loop per order, shared by the reference run and every fuse (a Loop is reusable)."""
    vx, vy = _xy(seed=5, n=48)
    model = fl.models.mlp([8, 3])
    val = fl.data.arrays(vx, vy, batch_size=16, device=True)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3)
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", tx).validate(model, val)
    plateau = dict(factor=0.5, patience=1, cooldown=1, min_lr=0.02)
    if order == "plateau_first":
        loop = loop.reduce_lr_on_plateau("validation_loss", **plateau)
        return loop.early_stop("validation_loss", patience=6, restore_best=True)
    loop = loop.early_stop("validation_loss", patience=6, restore_best=True)
    return loop.reduce_lr_on_plateau("validation_loss", **plateau)


@functools.cache
def _unfused_plateau(order: str) -> Any:
    """The unfused reference, run once per order and shared by every fuse."""
    return _plateau(order).run(_data(), epochs=30, fuse=False)


@pytest.mark.parametrize("fuse", ["run", BATCHES + 1, 3 * BATCHES + 1])
@pytest.mark.parametrize("order", ["plateau_first", "stop_first"])
def test_reduce_lr_on_plateau_on_the_device_gives_the_same_rates(fuse, order):
    plain = _unfused_plateau(order)
    fused = _plateau(order).run(_data(), epochs=30, fuse=fuse)
    _assert_same_run(fused, plain)
    rates = [h["learning_rate"] for h in plain.history.values()]
    assert len(set(rates)) >= 3  # the rate was reduced, more than once
    assert fused.stats["dispatch_splits"] == {}
    if fuse == "run":
        assert fused.stats["dispatches"] == 1


def _never_improves(y_true: Any, y_pred: Any) -> Any:
    return jax.numpy.float32(1.0)


def test_reduce_lr_on_plateau_at_min_lr_keeps_counting_on_the_device():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    loop = (
        fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", tx)
        .metric(_never_improves, "flat")
        .reduce_lr_on_plateau("flat", factor=0.1, patience=1, min_lr=0.05)
    )
    plain = loop.run(_data(), epochs=5, fuse=False)
    fused = loop.run(_data(), epochs=5, fuse="run")
    _assert_same_run(fused, plain)
    assert fused.stats["dispatches"] == 1
    # Reduced to the floor after epoch 1; epochs 2 to 4 each add one to the wait, as Keras.
    record = plain.handler_metadata["reduce_lr_on_plateau:flat"]
    assert (record["reductions"], record["wait"]) == (1, 3)


def test_reduce_lr_on_plateau_with_checkpoints_and_resume(tmp_path):
    base = _plateau("plateau_first")
    plain = _unfused_plateau("plateau_first")  # 30 epochs; its first epochs are the same
    first = base.checkpoint(str(tmp_path / "c"), filter={"every": 4}).run(
        _data(), epochs=6, fuse="run"
    )
    saved = fl.load_state(str(tmp_path / "c"))
    assert saved.epoch == 4 and first.epoch == 5  # saved at epochs 0 and 4
    resumed = base.run(_data(), saved, epochs=12, fuse="run")
    whole = base.run(_data(), saved, epochs=12)
    _assert_same_run(resumed, whole)
    assert resumed.history[3] == plain.history[3]


def test_chunks_beyond_the_epoch_reuse_their_program_across_run_lengths():
    loop = _trainer()
    loop.run(_data(), epochs=2, fuse=2 * BATCHES + 3)
    again = loop.run(_data(), epochs=5, fuse=2 * BATCHES + 3)
    assert again.stats["compiles"] == 0


def test_the_plateaus_rate_read_is_a_counted_host_read():
    """The learning rate a plateau starts each dispatch from is read through the run's
    `HostReads` (one counted read per dispatch), like every other host read."""
    vx, vy = _xy(seed=5, n=48)
    model = fl.models.mlp([8, 3])
    val = fl.data.arrays(vx, vy, batch_size=16, device=True)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3)
    base = fl.trainer(model, "sparse_categorical_cross_entropy", tx).validate(model, val)
    plain = base.run(_data(), epochs=6, fuse="run")
    plateau = base.reduce_lr_on_plateau("validation_loss", factor=0.5, patience=1)
    with_rate = plateau.run(_data(), epochs=6, fuse="run")
    assert plain.stats["dispatches"] == with_rate.stats["dispatches"] == 1
    assert with_rate.stats["host_syncs"] == plain.stats["host_syncs"] + 1


def test_a_handler_failing_on_a_replayed_state_is_told_why_it_has_no_params():
    def norm(state: fl.State) -> None:
        state.params["params"]  # None in an epoch replayed from a dispatch

    loop = _trainer().observe("epoch_completed", norm)
    with pytest.raises(TypeError) as caught:
        loop.run(_data(), epochs=3, fuse="run")
    (note,) = caught.value.__notes__
    assert "state.params are None" in note and "replayed" in note


@pytest.mark.parametrize("fuse", ["run", 32])
def test_a_metric_an_iteration_handler_writes_is_monitored_as_written(tmp_path, fuse):
    """The last writer wins (DESIGN §8): an iteration handler rewrites the epoch's loss at
    its last step, and early_stop and checkpoint(criteria=) judge the written value, on the
    host. On the device they read the accumulators, and the replay's check raised
    FusionError."""
    written = [5.0, 4.0, 4.5, 4.2, 4.1, 3.0]

    def write_loss(state: fl.State):
        if state.iteration == 5:  # an epoch's last of 6 steps
            return "continue", state.replace(
                metrics={**state.metrics, "loss": written[state.epoch]}
            )
        return None

    def loop(path):
        return (
            _trainer()
            .handle_event("iteration_completed", write_loss)
            .checkpoint(path, criteria="loss")
            .early_stop("loss", patience=2)
        )

    plain = loop(tmp_path / "plain").run(_data(), epochs=6, fuse=False)
    fused = loop(tmp_path / "fused").run(_data(), epochs=6, fuse=fuse)
    _assert_same_run(fused, plain)
    assert [h["loss"] for h in fused.history.values()] == written[:4]
    assert sorted(p.name for p in (tmp_path / "fused").iterdir()) == sorted(
        p.name for p in (tmp_path / "plain").iterdir()
    )


@pytest.mark.parametrize("fuse, steps, reached", [("run", 30, (2, 9)), (25, 25, (2, 4))])
def test_an_error_in_a_dispatchs_replay_leaves_a_state_that_says_its_step_state_ran_ahead(
    fuse, steps, reached
):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.integers(0, 3, 40).astype(np.int32)

    def full_disk(state: fl.State) -> None:
        if state.epoch == 0:
            raise OSError("no space left on device")

    loop = fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "adam")
    failing = loop.observe("epoch_completed", full_disk)
    data = fl.data.arrays(x, y, 4, device=True)
    with pytest.raises(OSError, match="no space") as caught:
        failing.run(data, epochs=3, fuse=fuse)
    state = caught.value.fuseloop_state
    # Its history ends at epoch 0; its step state is the dispatch's end, epochs later.
    assert sorted(state.history) == [0] and int(state.step_state["step"]) == steps
    assert tuple(state.handler_metadata["_step_state_reached"]) == reached
    with pytest.warns(RuntimeWarning, match=rf"from epoch 2, iteration {reached[1]} \(a dispatch"):
        resumed = loop.run(data, state, epochs=3, fuse=fuse)
    assert "_step_state_reached" not in resumed.handler_metadata  # said once, not carried on


def test_a_dispatch_stopped_mid_epoch_is_resumed_with_one_warning_saying_where_its_state_is():
    """An observer raising mid-epoch inside a multi-epoch dispatch: the resume also warned
    that the State "stopped inside epoch 1 after stepping 4 of its batches", counting the
    events replayed, while its step state is the dispatch's end."""
    rng = np.random.default_rng(0)
    data = fl.data.arrays(
        rng.normal(size=(56, 4)).astype(np.float32),
        rng.integers(0, 3, 56).astype(np.int32),
        8,
        device=True,
    )
    raising = [True]

    def fails_once(state: fl.State) -> None:
        if raising[0] and (state.epoch, state.iteration) == (1, 3):
            raise RuntimeError("a full disk")

    loop = fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "sgd")
    loop = loop.observe("iteration_completed", fails_once)
    with pytest.raises(RuntimeError, match="a full disk") as caught:
        loop.run(data, epochs=4, fuse="run")
    raising[0] = False
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        loop.run(data, caught.value.fuseloop_state, epochs=4, fuse="run")
    said = [str(w.message) for w in caught_warnings if w.category is RuntimeWarning]
    assert len(said) == 1 and "step state is from epoch 3, iteration 6" in said[0], said
