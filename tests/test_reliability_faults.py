"""Faults lose nothing: a non-finite loss, a raising handler, a raising data source, and
donation never touching the caller's arrays (docs/reliability.md)."""

from __future__ import annotations

import functools
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, counter_init, counter_loop, make_batches, tiny_mlp, trainer

SPARSE = "sparse_categorical_cross_entropy"
BAD_AT = 7  # the iteration whose batch holds NaN inputs
CHUNKS = [False, 1, 4, 32]
COUNTED = ("iteration_started", "iteration_completed", "epoch_completed", "halted", "completed")


class Probe:
    """Counts events and halts at `stop_at` = (epoch, iteration) when set: one compiled
    loop serves every test of this module (a new Loop would compile again)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.stop_at: tuple[int, int] | None = None

    def reset(self, stop_at: tuple[int, int] | None = None) -> Probe:
        self.counts, self.stop_at = {}, stop_at
        return self

    def attach(self, loop: fl.Loop) -> fl.Loop:
        for event in COUNTED:
            loop = loop.handle_event(event, self._counter(event))
        return loop.handle_event("iteration_started", self._stop)

    def _counter(self, event: str):
        def count(state: fl.State) -> None:
            self.counts[event] = self.counts.get(event, 0) + 1

        return count

    def _stop(self, state: fl.State) -> str | None:
        return "halt_loop" if (state.epoch, state.iteration) == self.stop_at else None


PROBE = Probe()
COUNTER = counter_loop()  # one Loop for the module; handlers added to it share its programs


@pytest.fixture(scope="module")
def plain_loop() -> fl.Loop:
    return fl.trainer(tiny_mlp(), SPARSE, "adam")


@pytest.fixture(scope="module")
def debug_nans_loop() -> fl.Loop:
    """plain_loop's configuration for the runs under jax.debug_nans: a Loop that ran under
    it no longer donates its step state, which the donation tests below need."""
    return fl.trainer(tiny_mlp(), SPARSE, "adam")


@pytest.fixture(scope="module")
def guarded_loop(plain_loop) -> fl.Loop:
    """The guarded trainer, no handler: it reads the guard's flag once per epoch."""
    return plain_loop.terminate_on_nan()


@pytest.fixture(scope="module")
def nan_loop(guarded_loop) -> fl.Loop:
    # Handlers only: it shares guarded_loop's compiled programs.
    return PROBE.attach(guarded_loop)


def poisoned(batches: list[Any], at: int) -> list[Any]:
    out = list(batches)
    x, y = out[at]
    out[at] = (np.full_like(x, np.nan), y)
    return out


# --------------------------------------------------------------------------- terminate_on_nan
@pytest.fixture(scope="module")
def before_nan(nan_loop) -> fl.State:
    """The reference: an unfused run halted by a handler just before the bad iteration."""
    PROBE.reset(stop_at=(0, BAD_AT))
    return nan_loop.run(make_batches(12), epochs=3)


@pytest.mark.parametrize(
    "fuse,device,steps",
    [(False, False, "iteration 7"), (4, False, "iterations 4-7"), (4, True, "iterations 4-7")],
)
def test_an_error_the_device_raises_names_its_epoch_and_iterations(
    debug_nans_loop, fuse, device, steps
):
    """jax.debug_nans raises where a step makes a NaN, inside fuseloop's loop ("encountered
    in while"): the note says which steps those were."""
    data = poisoned(make_batches(12), BAD_AT)
    if device:
        x, y = (np.concatenate(part) for part in zip(*data, strict=True))
        data = fl.data.arrays(x, y, batch_size=len(data[0][1]), shuffle=False, device=True)
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as caught:
        debug_nans_loop.run(data, fuse=fuse)
    assert f"fuseloop: raised by the steps of epoch 0, {steps}" in caught.value.__notes__
    # Where JAX saw the NaN leave the device loop, the note says how to have it named.
    hinted = any("run(..., fuse=False, jit=False)" in note for note in caught.value.__notes__)
    assert hinted == ("encountered in while" in str(caught.value))


@pytest.mark.parametrize("population", [None, 2])
def test_an_error_the_device_raises_in_a_whole_run_names_its_dispatch(debug_nans_loop, population):
    """A population's dispatch had no note."""
    x, y = (np.concatenate(part) for part in zip(*poisoned(make_batches(12), BAD_AT), strict=True))
    data = fl.data.arrays(x, y, batch_size=len(y) // 12, shuffle=False, device=True)
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as caught:
        debug_nans_loop.run(data, epochs=2, fuse="run", population=population)
    assert "fuseloop: raised by the 24 steps of the dispatch from epoch 0, iteration 0" in (
        caught.value.__notes__
    )
    assert any("run(..., fuse=False, jit=False)" in note for note in caught.value.__notes__)


def _raises_at(global_step: int) -> fl.Loop:
    """A counter loop whose step calls back to the host, which raises at `global_step`."""

    def host(n: Any) -> None:
        if int(n) == global_step:
            raise RuntimeError(f"the host callback raises at step {global_step}")

    def step(batch: Any, s: dict[str, Any]) -> dict[str, Any]:
        jax.debug.callback(host, s["n"])
        return {"n": s["n"] + 1, "total": s["total"] + batch[0].sum()}

    return fl.loop(step)


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="a GPU reports a callback's error after the run, outside it",
)
@pytest.mark.parametrize("fuse", [False, 4])
def test_a_step_failing_on_the_device_keeps_the_epochs_before_it(fuse):
    """A callback raising in epoch 1's first chunk: epoch 0 (all its steps ran) is in the
    State's history, fused as unfused, though the fused run had opened epoch 1 before
    reading epoch 0; the step state went with the failed dispatch, and a note says so."""
    with pytest.raises(RuntimeError, match="raises at step 9") as caught:
        _raises_at(9).run(make_batches(6), counter_init(), epochs=3, fuse=fuse)
    reached = caught.value.fuseloop_state
    assert (reached.epoch, list(reached.history)) == (1, [0])
    assert reached.event_counts["epoch_completed"] == 1
    assert any("no step state to save or resume from" in n for n in caught.value.__notes__)
    with pytest.raises(RuntimeError, match="an error's fuseloop_state"):
        fl.save_state(reached, "unused")


@pytest.mark.parametrize("fuse", CHUNKS)
def test_nan_keeps_params_from_before_the_bad_step(nan_loop, before_nan, fuse):
    data = poisoned(make_batches(12), BAD_AT)
    PROBE.reset()
    with pytest.warns(RuntimeWarning, match=rf"non-finite at epoch 0, iteration {BAD_AT}"):
        state = nan_loop.run(data, epochs=3, fuse=fuse)
    assert state.status == "halted"
    assert (state.epoch, state.iteration) == (0, BAD_AT)
    assert state.handler_metadata["_nonfinite_at"] == {"epoch": 0, "iteration": BAD_AT}
    assert_tree_equal(state.step_state, before_nan.step_state, "step_state")
    assert int(state.step_state["step"]) == BAD_AT
    # The bad step's loss is not averaged in; the halted epoch is recorded as any halt is.
    assert "loss" in state.metrics
    assert state.metrics == before_nan.metrics and state.history == before_nan.history
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(state.params))
    # The same events at every chunk size: the bad iteration started, never completed, no
    # epoch completed, the loop halted.
    assert PROBE.counts == {
        "iteration_started": BAD_AT + 1,
        "iteration_completed": BAD_AT,
        "halted": 1,
    }
    assert state.event_counts["iteration_started"] == {"total": BAD_AT + 1, "epoch": BAD_AT + 1}
    assert state.event_counts["iteration_completed"] == {"total": BAD_AT, "epoch": BAD_AT}
    assert (state.event_counts["halted"], state.event_counts["completed"]) == (1, 0)


@pytest.mark.parametrize("fuse", [False, 4])
def test_nan_in_a_later_epoch(nan_loop, fuse):
    data = make_batches(6)
    bad_epoch, bad_at = 1, 3
    epochs = iter(range(10))

    def source() -> Iterator[Any]:
        return iter(poisoned(data, bad_at) if next(epochs) == bad_epoch else data)

    PROBE.reset()
    with pytest.warns(RuntimeWarning, match=rf"epoch {bad_epoch}, iteration {bad_at}"):
        state = nan_loop.run(source, epochs=3, fuse=fuse)
    counts = PROBE.counts
    PROBE.reset(stop_at=(bad_epoch, bad_at))  # the reference halts before the bad step
    reference = nan_loop.run(data, epochs=3)
    assert reference.status == state.status == "halted"
    assert_tree_equal(state.step_state, reference.step_state, "step_state")
    assert state.history[0] == reference.history[0]
    assert state.handler_metadata["_nonfinite_at"] == {"epoch": bad_epoch, "iteration": bad_at}
    assert counts == PROBE.counts


@pytest.mark.parametrize("fuse", [False, 4])
def test_finite_runs_are_unchanged_by_the_guard(nan_loop, plain_loop, fuse):
    data = make_batches(8)
    plain = plain_loop.run(data, epochs=2, fuse=fuse)
    PROBE.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = nan_loop.run(data, epochs=2, fuse=fuse)
    assert state.status == "completed" and "_nonfinite_at" not in state.handler_metadata
    assert_tree_equal(state.step_state, plain.step_state)
    assert state.history == plain.history


class DenseBatchNorm(nn.Module):
    """A BatchNorm model: XLA fuses its step otherwise if the guard touches the step's
    graph (a select per step did), so it checks that the guard leaves the step alone."""

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x)))
        return nn.Dense(3)(x)


@pytest.fixture(scope="module")
def batchnorm_loops() -> tuple[fl.Loop, fl.Loop]:
    """The BatchNorm trainer, unguarded and guarded (one Loop each for the module)."""
    plain = fl.trainer(DenseBatchNorm(), SPARSE, "adam")
    return plain, plain.terminate_on_nan()


@pytest.mark.parametrize("fuse", [False, 4])
def test_the_guard_leaves_a_batchnorm_run_bitwise_alone(batchnorm_loops, fuse):
    plain, guard = batchnorm_loops
    data = make_batches(12)
    reference = plain.run(data, epochs=2, fuse=fuse)
    guarded = guard.run(data, epochs=2, fuse=fuse)
    assert_tree_equal(guarded.step_state, reference.step_state, "step_state")
    assert guarded.history == reference.history
    # A non-finite step is undone to the step state the unguarded run had before it.
    halt_at_9 = lambda s: "halt_loop" if s.iteration == 9 else None  # noqa: E731
    before = plain.handle_event("iteration_started", halt_at_9).run(data)  # unfused: exact
    with pytest.warns(RuntimeWarning, match="iteration 9"):
        halted = guard.run(poisoned(data, 9), fuse=fuse)
    assert_tree_equal(halted.step_state, before.step_state, "step_state")


# --------------------------------------------------------------------------- raising handlers
class HandlerFailure(Exception):
    pass


@pytest.mark.parametrize("fuse", [False, 3])
@pytest.mark.parametrize(
    "event, filter, where",
    [
        # State's fields count from 0; the note also gives the log's numbers
        (
            "iteration_completed",
            {"once": 5},
            "epoch 0, iteration 4; counted from 0 as the "
            "State's fields are, the log's Epoch 1, iteration 5)",
        ),
        ("epoch_completed", {"once": 2}, "epoch 1"),
        ("started", "always", "epoch 0"),
    ],
)
def test_raising_handler_keeps_its_type_with_a_note(fuse, event, filter, where):
    def explode(state: fl.State) -> None:
        raise HandlerFailure("kaboom")

    opened, closed = [], []

    def batches() -> Iterator[Any]:
        opened.append(1)
        try:
            yield from make_batches(6)
        finally:
            closed.append(1)

    loop = COUNTER.handle_event(event, explode, filter, name="exploder")
    with pytest.raises(HandlerFailure, match="kaboom") as info:
        loop.run(batches, counter_init(), epochs=3, fuse=fuse)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"handler exploder on event '{event}'" in notes and where in notes
    assert any(frame.name == "explode" for frame in traceback.extract_tb(info.tb))
    assert len(closed) == len(opened) >= 1  # every iterator the run opened was closed


def test_raising_handler_without_a_name_is_named_by_its_function():
    def my_broken_handler(state: fl.State) -> None:
        raise KeyError("missing")

    loop = COUNTER.handle_event("epoch_completed", my_broken_handler)
    with pytest.raises(KeyError) as info:
        loop.run(make_batches(2), counter_init())
    assert "my_broken_handler" in "\n".join(info.value.__notes__)


# --------------------------------------------------------------------------- raising data
class DataFailure(Exception):
    pass


def failing_source(fail_epoch: int, fail_at: int, closed: list[int]) -> Any:
    data = make_batches(6)
    epochs = iter(range(100))

    def one_epoch() -> Iterator[Any]:
        epoch = next(epochs)
        try:
            for i, batch in enumerate(data):
                if (epoch, i) == (fail_epoch, fail_at):
                    raise DataFailure(f"corrupt record {i}")
                yield batch
        finally:
            closed.append(epoch)

    return one_epoch


@pytest.mark.parametrize("fuse", [False, 1, 4])
def test_data_iterator_raising_mid_epoch_keeps_type_traceback_and_notes(fuse):
    closed: list[int] = []
    with pytest.raises(DataFailure, match="corrupt record 4") as info:
        COUNTER.run(failing_source(1, 4, closed), counter_init(), epochs=3, fuse=fuse)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "data source" in notes and "epoch 1, iteration 4" in notes
    assert any(frame.name == "one_epoch" for frame in traceback.extract_tb(info.tb))
    assert closed == [0, 1]  # every iterator the run opened was closed


def test_one_shot_generator_raising_mid_epoch():
    def generator() -> Iterator[Any]:
        yield from make_batches(3)
        raise DataFailure("disk gone")

    with pytest.raises(DataFailure) as info:
        COUNTER.run(generator(), counter_init(), epochs=2)
    assert "epoch 0, iteration 3" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("kind", ["one_shot", "callable"])
def test_a_source_failing_mid_chunk_steps_what_it_pulled_before_raising(kind):
    """The batches pulled into a chunk before the source raised are stepped, then the
    error is raised: the State it carries is the unfused run's, bitwise (exact consumption;
    a one-shot iterator's batches would otherwise be lost untrained)."""
    batches = make_batches(20)
    reached = {}
    for fuse in (False, 4, True):
        pulled: list[int] = []

        def generator(pulled: list[int] = pulled) -> Iterator[Any]:
            for i, batch in enumerate(batches):
                if i == 13:
                    raise DataFailure("corrupt record 13")
                pulled.append(i)
                yield batch

        source = generator() if kind == "one_shot" else generator
        with pytest.raises(DataFailure, match="corrupt record 13") as info:
            COUNTER.run(source, counter_init(), epochs=2, fuse=fuse)
        assert len(pulled) == 13
        reached[fuse] = info.value.fuseloop_state  # type: ignore[attr-defined]
    plain = reached[False]
    assert int(plain.step_state["n"]) == 13 and plain.iteration == 12
    for fuse in (4, True):
        fused = reached[fuse]
        assert_tree_equal(fused.step_state, plain.step_state, f"step state, fuse={fuse}")
        assert (fused.epoch, fused.iteration) == (plain.epoch, plain.iteration)
        assert fused.event_counts == plain.event_counts


# --------------------------------------------------------------------------- donation safety
def readable(tree: Any) -> Any:
    """Host copies of every leaf: raises if a buffer was donated (deleted)."""
    return jax.tree.map(lambda a: np.array(a, copy=True), tree)


@pytest.mark.parametrize("fuse", [False, 1, 4])
def test_initial_variables_stay_readable(plain_loop, fuse):
    x = make_batches(1)[0][0]
    variables = jax.device_put(tiny_mlp().init(jax.random.PRNGKey(3), jnp.asarray(x)))
    before = readable(variables)
    state = plain_loop.run(make_batches(6), variables, epochs=2, fuse=fuse)
    assert_tree_equal(readable(variables), before, "initial variables")
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(variables))
    assert int(state.step_state["step"]) == 12


@pytest.mark.parametrize("fuse", [False, 4])
def test_custom_loop_init_state_stays_readable(fuse):
    init = {"n": jnp.zeros((), jnp.int32), "total": jnp.zeros((), jnp.float32)}
    state = COUNTER.run(make_batches(5), init, epochs=2, fuse=fuse)
    assert int(init["n"]) == 0 and float(init["total"]) == 0.0
    assert int(state.step_state["n"]) == 10


@pytest.mark.parametrize("fuse", [False, 4])
def test_a_state_passed_back_in_stays_readable(plain_loop, fuse):
    loop = plain_loop
    first = loop.run(make_batches(4), epochs=1, fuse=fuse)
    kept = readable(first.step_state)
    second = loop.run(make_batches(4), first, epochs=2, fuse=fuse)
    assert_tree_equal(readable(first.step_state), kept, "the State passed back in")
    assert int(second.step_state["step"]) == 8
    third = loop.run(make_batches(4), first, epochs=2, fuse=fuse)  # the same State, again
    assert_tree_equal(third.step_state, second.step_state)


@pytest.mark.parametrize("fuse", [False, 4])
def test_evaluator_params_and_device_batches_stay_readable(plain_loop, fuse):
    params = plain_loop.run(make_batches(2)).params
    kept = readable(params)
    device_batches = [jax.device_put(b) for b in make_batches(4)]
    fl.evaluator(tiny_mlp()).metric("accuracy").run(device_batches, params, fuse=fuse)
    assert_tree_equal(readable(params), kept)
    readable(device_batches)
    plain_loop.run(device_batches, params, fuse=fuse)
    assert_tree_equal(readable(params), kept)
    readable(device_batches)


def test_arrays_a_handler_returns_are_not_the_ones_donated(plain_loop):
    """The State returned by run is never donated, even after a handler swapped params."""
    loop = plain_loop
    x = jnp.asarray(make_batches(1)[0][0])
    fresh = jax.device_put(tiny_mlp().init(jax.random.PRNGKey(9), x))
    kept = readable(fresh)

    def reset(state: fl.State) -> Any:
        return "continue", state.replace(step_state={**state.step_state, "params": fresh})

    result = loop.handle_event("epoch_completed", reset, {"once": 1}).run(make_batches(3), epochs=2)
    assert_tree_equal(readable(fresh), kept, "arrays a handler handed to the loop")
    readable(result.step_state)


@pytest.mark.parametrize("event", ["epoch_completed", "iteration_completed"])
def test_arrays_a_handler_writes_into_the_step_state_in_place_are_not_donated(plain_loop, event):
    # `state.step_state["params"] = fresh`, returning None: the change was taken as the
    # carry's own, and the next step donated the user's arrays (deleted after the run).
    x = jnp.asarray(make_batches(1)[0][0])
    fresh = jax.device_put(tiny_mlp().init(jax.random.PRNGKey(9), x))
    kept = readable(fresh)

    def reset(state: fl.State) -> None:
        state.step_state["params"] = fresh

    swapped = plain_loop.handle_event(event, reset, {"once": 1}).run(make_batches(3), epochs=2)
    assert_tree_equal(readable(fresh), kept, "arrays a handler wrote in place")

    def returned(state: fl.State) -> Any:  # the documented form: the same run
        return "continue", state.replace(step_state={**state.step_state, "params": fresh})

    same = plain_loop.handle_event(event, returned, {"once": 1}).run(make_batches(3), epochs=2)
    assert_tree_equal(swapped.step_state, same.step_state)


@pytest.mark.parametrize("fuse", [False, 4])
def test_a_state_kept_from_a_handler_is_refused_by_name_once_its_arrays_are_gone(
    plain_loop, fuse, tmp_path
):
    kept: list[fl.State] = []
    loop = plain_loop.handle_event("epoch_completed", kept.append)
    loop.run(make_batches(4), epochs=2, fuse=fuse)
    gone = kept[0]  # its arrays were donated to the next epoch's steps
    assert any(leaf.is_deleted() for leaf in jax.tree.leaves(gone.step_state))
    assert " deleted (reused by the run after this State was kept)>" in repr(gone)
    x = make_batches(1)[0][0]
    for call, argument in [
        (lambda: plain_loop.run(make_batches(4), gone, epochs=3), "init_state"),
        (lambda: plain_loop.run(make_batches(4), gone.params, epochs=1), "init_state"),
        (lambda: fl.predict(tiny_mlp(), gone, x), "variables_or_state"),
        (lambda: fl.save_state(gone, tmp_path / "kept"), "state"),
    ]:
        with pytest.raises(RuntimeError, match=rf"^{argument} holds arrays that were deleted"):
            call()
    assert not (tmp_path / "kept").exists()


# The guard with no iteration handler reads its flag once per epoch, not once per chunk:
# the bad step can be anywhere in a chunk, or the epoch's last.
@pytest.mark.parametrize("bad_at", [0, 5, 7, 8, 11])
@pytest.mark.parametrize("fuse", [4, 32])
def test_a_guard_read_at_the_epochs_end_halts_where_the_unfused_loop_does(
    guarded_loop, bad_at, fuse
):
    guarded = guarded_loop  # no iteration handler
    data = poisoned(make_batches(12), bad_at)
    with pytest.warns(RuntimeWarning, match=rf"epoch 0, iteration {bad_at}"):
        reference = guarded.run(data, epochs=2)
    with pytest.warns(RuntimeWarning, match=rf"epoch 0, iteration {bad_at}"):
        state = guarded.run(data, epochs=2, fuse=fuse)
    assert state.status == reference.status == "halted"
    assert (state.epoch, state.iteration) == (reference.epoch, reference.iteration)
    assert state.handler_metadata["_nonfinite_at"] == {"epoch": 0, "iteration": bad_at}
    assert_tree_equal(state.step_state, reference.step_state, "step_state")
    assert state.event_counts == reference.event_counts
    assert state.metrics == reference.metrics and state.history == reference.history


@pytest.fixture(scope="module")
def diverging() -> tuple[fl.Loop, Any, fl.State]:
    """A guarded run on device data that diverges, and its unfused run (the reference)."""
    x = np.concatenate([b[0] for b in make_batches(6)])
    y = np.concatenate([b[1] for b in make_batches(6)])
    # A learning rate this large diverges within a few epochs.
    loop = fl.trainer(tiny_mlp(), SPARSE, optax.sgd(1e4)).terminate_on_nan()
    data = fl.data.arrays(x, y, batch_size=4, shuffle=False, device=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return loop, data, loop.run(data, epochs=30)


@pytest.mark.parametrize("fuse", [4, "run"])
def test_a_deferred_guard_on_device_data_halts_in_a_later_epoch(diverging, fuse):
    loop, data, reference = diverging
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        state = loop.run(data, epochs=30, fuse=fuse)
    assert reference.status == "halted", "the reference run must meet a non-finite loss"
    assert state.handler_metadata["_nonfinite_at"] == reference.handler_metadata["_nonfinite_at"]
    assert_tree_equal(state.step_state, reference.step_state, "step_state")
    assert state.event_counts == reference.event_counts and state.history == reference.history


@functools.cache
def _halving_loop(guarded: bool = False) -> fl.Loop:
    """A custom loop whose state follows its batches' values (a NaN batch makes it NaN),
    guarded or not; one Loop each for the module."""
    if guarded:
        return _halving_loop().terminate_on_nan()

    def step(batch, s):
        w = s["w"] * 0.5 + jnp.mean(batch[0])
        return {"w": w, "loss": w}

    init = lambda batch, seed: {"w": jnp.float32(0), "loss": jnp.float32(0)}  # noqa: E731
    return fl.loop(step, init).metric("loss")


def _batch(value: float) -> tuple[np.ndarray, np.ndarray]:
    return np.full((2, 1), value, np.float32), np.zeros(2, np.int32)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_an_error_pulled_ahead_in_an_epoch_a_handler_ended_is_not_raised_later(prefetch):
    # Batch 3 of epoch 0's pass fails; a handler ends that epoch at iteration 1, so the
    # unfused loop never meets it. A fused run pulled it ahead: it belongs to that pass.
    epochs = iter(range(10))

    def data():
        e = next(epochs)
        for i in range(6):
            if (e, i) == (0, 3):
                raise OSError("bad record")
            yield _batch(float(i))

    halt = lambda s: "halt_epoch" if (s.epoch, s.iteration) == (0, 1) else None  # noqa: E731
    loop = _halving_loop().handle_event("iteration_completed", halt)
    state = loop.run(data, 0, epochs=3, fuse=2, prefetch=prefetch)
    assert state.status == "completed" and sorted(state.history) == [0, 1, 2]


@pytest.mark.parametrize("fuse", [False, 1, 2, 4])
def test_a_non_finite_step_halts_before_a_later_batch_that_fails_to_load(fuse):
    # The guard's flag of chunks replayed without reading it is read before a pull's
    # error is raised: the unfused loop halts at batch 1 and never pulls batch 5.
    def data():
        for i in range(8):
            if i == 5:
                raise OSError("cannot read batch 5")
            yield _batch(np.nan if i == 1 else float(i))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _halving_loop(guarded=True).run(data, 0, epochs=1, fuse=fuse)
    assert (state.status, state.iteration) == ("halted", 1)
    assert float(state.step_state["w"]) == 0.0  # batch 0's zeros, the bad step not applied


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_step_state_changed_in_place_to_share_an_array_runs_as_the_returned_form(fuse):
    # It was refused (one buffer donated twice); a change made in place is copied now, as
    # a returned State's is, so the two leaves no longer share their arrays.
    def params_from_mu(state: fl.State) -> None:
        # The optimizer's first moments, whose arrays the optimizer state keeps too.
        state.step_state["params"] = {"params": state.step_state["opt_state"][0].mu}

    def returned(state: fl.State) -> Any:
        mu = {"params": state.step_state["opt_state"][0].mu}
        return "continue", state.replace(step_state={**state.step_state, "params": mu})

    base = trainer(optimizer=optax.adam(1e-2))
    in_place = base.handle_event("epoch_completed", params_from_mu)
    ran = in_place.run(make_batches(n=4), epochs=2, fuse=fuse)
    same = base.handle_event("epoch_completed", returned).run(
        make_batches(n=4), epochs=2, fuse=fuse
    )
    assert_tree_equal(ran.step_state, same.step_state)


@pytest.mark.filterwarnings("ignore:data. the run ended holding")  # pulled after the bad one
@pytest.mark.parametrize("fuse", [3, True, "auto"])
def test_a_batch_the_checks_refuse_mid_chunk_leaves_the_steps_before_it_as_unfused(
    plain_loop, fuse
):
    # Label 7 of 3 classes at batch 4: the unfused loop steps batches 0-3, then refuses it;
    # a fused chunk holding it steps the batches before it too, then raises the same error.
    batches = make_batches(n=7)
    batches[4] = (batches[4][0], np.full_like(batches[4][1], 7))

    def run(fuse_value: Any) -> tuple[Any, list[int]]:
        seen: list[int] = []
        loop = plain_loop.observe("iteration_completed", lambda s: seen.append(s.iteration))
        with pytest.raises(ValueError, match="7") as refused:
            loop.run(iter(batches), fuse=fuse_value)
        return refused.value.fuseloop_state, seen

    (unfused, seen_unfused), (fused, seen_fused) = run(False), run(fuse)
    assert seen_fused == seen_unfused == [0, 1, 2, 3]
    assert_tree_equal(fused.step_state, unfused.step_state, "the steps before the refused batch")


@pytest.mark.filterwarnings("ignore:data. the run ended holding")
def test_of_two_refused_batches_in_a_chunk_the_first_ones_error_is_raised(plain_loop):
    batches = make_batches(n=7)
    batches[4] = (batches[4][0], np.full_like(batches[4][1], 7))  # the label refused first
    batches[5] = (np.zeros((4, 5), np.float32), batches[5][1])  # then another shape
    for fuse in (False, 3):
        with pytest.raises(ValueError, match=r"iteration 4: y holds the label 7"):
            plain_loop.run(iter(batches), fuse=fuse)
