"""Data consumption of the fused loop: exactly as many batches
pulled as stepped, iterators closed when a run stops reading early, and ragged chunks
rejected with `fl.FusionError`.

The step counter of a custom counting loop (`step_state["n"]`) says how many batches were
stepped; a counting generator says how many were pulled."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import fuseloop as fl
from conftest import (
    CountingGenerator,
    counter_init,
    counter_loop,
    counting_generator,
    make_batches,
    trainer,
)

DATA = make_batches(30)
CONTROL: dict = {}


def halt_when_told(state: fl.State):
    if (state.epoch, state.iteration) == CONTROL.get("at"):
        return CONTROL["status"]
    return None


PLAIN = counter_loop()
HALTING = counter_loop().handle_event("iteration_completed", halt_when_told)


def run(loop, data, at=None, status=None, **kwargs):
    CONTROL.clear()
    if at is not None:
        CONTROL.update(at=at, status=status)
    return loop.run(data, counter_init(), **kwargs)


@pytest.mark.parametrize("fuse", [False, 1, 4, 7, 32])
def test_one_shot_generator_is_consumed_exactly(fuse):
    source = CountingGenerator(DATA)
    state = run(PLAIN, source, fuse=fuse)
    assert source.pulls == int(state.step_state["n"]) == 30


@pytest.mark.parametrize("fuse", [False, 4, 7, 32])
def test_iterations_bound_pulls_exactly_the_bounded_batches(fuse):
    source = CountingGenerator(DATA)
    state = run(PLAIN, source, epochs=3, iterations=7, fuse=fuse)
    assert source.pulls == int(state.step_state["n"]) == 21
    assert source.closed  # the run stopped reading an unexhausted generator: closed


@pytest.mark.parametrize("fuse", [4, 7, 32])
def test_callable_source_with_iterations_pulls_no_more_than_the_epoch_needs(fuse):
    counters: list[dict] = []

    def source():
        counters.append({})
        return counting_generator(DATA, counters[-1])

    state = run(PLAIN, source, epochs=2, iterations=9, fuse=fuse)
    assert int(state.step_state["n"]) == 18
    assert [c["pulls"] for c in counters] == [9, 9]
    assert [c.get("finally") for c in counters] == [1, 1]


@pytest.mark.parametrize("fuse,steps", [(False, 7), (1, 7), (4, 8), (5, 10), (32, 30)])
def test_halt_loop_with_a_one_shot_generator_pulls_only_what_was_stepped(fuse, steps):
    source = CountingGenerator(DATA)
    state = run(HALTING, source, at=(0, 6), status="halt_loop", fuse=fuse)
    assert int(state.step_state["n"]) == steps
    assert source.pulls == steps
    assert source.closed
    assert state.status == "halted"


@pytest.mark.parametrize("fuse,first_epoch", [(False, 7), (4, 8), (5, 10)])
def test_halt_epoch_with_a_one_shot_generator_leaves_the_rest_for_the_next_epoch(fuse, first_epoch):
    source = CountingGenerator(DATA)
    state = run(HALTING, source, at=(0, 6), status="halt_epoch", epochs=2, fuse=fuse)
    # Epoch 1 continues where epoch 0 stopped pulling, and drains the generator.
    assert source.pulls == int(state.step_state["n"]) == 30
    assert state.event_counts["iteration_completed"] == {
        "total": 7 + 30 - first_epoch,
        "epoch": 30 - first_epoch,
    }


def test_a_halt_at_iteration_started_keeps_its_unstepped_batch_for_the_next_epoch():
    # Unfused, the halt comes after the batch was pulled and before its step: the batch
    # was dropped, so epoch 1 started one batch later and one batch never trained.
    source = CountingGenerator(DATA)
    loop = counter_loop().handle_event("iteration_started", halt_when_told)
    state = run(loop, source, at=(0, 6), status="halt_epoch", epochs=2, fuse=False)
    assert source.pulls == int(state.step_state["n"]) == 30
    assert state.event_counts["iteration_completed"] == {"total": 6 + 24, "epoch": 24}
    # The last batch halted, then stepped alone by the next epoch: that epoch ran.
    loop = counter_loop().handle_event("iteration_started", halt_when_told)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = run(loop, iter(DATA[:4]), at=(0, 3), status="halt_epoch", epochs=2, fuse=False)
    assert int(state.step_state["n"]) == 4 and sorted(state.history) == [0, 1]


@pytest.mark.parametrize("event", ["epoch_started", "iteration_started"])
def test_a_run_that_ends_holding_an_iterators_unstepped_batch_says_so(event):
    # A plain iterator cannot take a batch back, so a resume over it starts after the one
    # the halted run pulled; a run that steps what it pulls says nothing.
    loop = counter_loop().handle_event(event, halt_when_told)
    iterator = iter(DATA)
    with pytest.warns(RuntimeWarning, match=r"ended holding 1 batch .*one-shot iterator.*list"):
        state = run(loop, iterator, at=(0, 0), status="halt_loop", fuse=False)
    assert int(state.step_state["n"]) == 0
    assert next(iterator)[0] is DATA[1][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(loop, iter(DATA), epochs=1, iterations=5, fuse=False)


@pytest.mark.parametrize(("fuse", "unstepped"), [(False, 0), (3, 1), (8, 3)])
def test_a_non_finite_halt_names_the_chunks_batches_it_pulled_and_did_not_step(fuse, unstepped):
    # The guard ends a fused chunk at its non-finite step (batch 4); the chunk's later
    # batches were pulled with it, which a plain iterator cannot take back.
    data = [(x.copy(), y) for x, y in DATA[:10]]
    data[4][0][0, 0] = np.nan
    iterator = iter(data)
    loop = trainer(optimizer="sgd").terminate_on_nan()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.run(iterator, epochs=1, fuse=fuse)
    assert state.iteration == 4 and state.status == "halted"
    held = [str(w.message) for w in caught if "did not step" in str(w.message)]
    if unstepped:
        assert held and f"holding {unstepped} batch" in held[0]
        assert "terminate_on_nan halted the fused chunk" in held[0]
    else:
        assert not held
    assert next(iterator)[0] is data[5 + unstepped][0]


@pytest.mark.parametrize("fuse", [False, 4])
def test_generator_finally_runs_on_early_stop(fuse):
    counter: dict = {}
    run(HALTING, counting_generator(DATA, counter), at=(0, 2), status="halt_loop", fuse=fuse)
    assert counter["finally"] == 1


@pytest.mark.parametrize("fuse", [False, 4])
def test_generator_finally_runs_when_a_handler_raises(fuse):
    counter: dict = {}

    def boom(state):
        if state.iteration == 5:
            raise RuntimeError("boom")

    loop = counter_loop().handle_event("iteration_completed", boom)
    with pytest.raises(RuntimeError, match="boom"):
        loop.run(counting_generator(DATA, counter), counter_init(), fuse=fuse)
    assert counter["finally"] == 1


# --------------------------------------------------------------------------- ragged data
def ragged(at: int, x_shape=None, x_dtype=None):
    data = make_batches(12)
    x, y = data[at]
    if x_shape is not None:
        x = np.zeros(x_shape, np.float32)
    if x_dtype is not None:
        x = x.astype(x_dtype)
    data[at] = (x, y)
    return data


@pytest.mark.parametrize("fuse", [4, 5, 32])
def test_ragged_shape_raises_fusion_error_naming_batch_and_shapes(fuse):
    with pytest.raises(fl.FusionError) as info:
        run(PLAIN, ragged(7, x_shape=(3, 3)), fuse=fuse)
    message = str(info.value)
    assert "7" in message and "(4, 3)" in message and "(3, 3)" in message
    assert "fuse=False" in message
    assert isinstance(info.value, ValueError)


def test_ragged_dtype_raises_fusion_error_naming_dtypes():
    with pytest.raises(fl.FusionError) as info:
        run(PLAIN, ragged(6, x_dtype=np.float16), fuse=4)
    message = str(info.value)
    assert "6" in message and "float32" in message and "float16" in message


def test_ragged_last_batch_alone_in_its_chunk_is_rejected():
    """12 batches at K=11: the short last batch is alone in the last chunk. Every batch of
    a fused epoch must share shape and dtype (one compiled program per epoch)."""
    data = ragged(11, x_shape=(2, 3))
    data[11] = (data[11][0], data[11][1][:2])
    with pytest.raises(fl.FusionError, match="11"):
        run(PLAIN, data, fuse=11)


def test_ragged_data_closes_the_generator_and_runs_unfused():
    counter: dict = {}
    with pytest.raises(fl.FusionError):
        run(PLAIN, counting_generator(ragged(5, x_shape=(3, 3)), counter), fuse=4)
    assert counter["finally"] == 1
    state = run(PLAIN, ragged(5, x_shape=(3, 3)), fuse=False)
    assert int(state.step_state["n"]) == 12


@pytest.mark.parametrize("fuse", [False, 4])
def test_a_one_shot_iterator_that_runs_out_inside_an_epoch_says_that_epoch_is_short(fuse):
    # 10 batches as epochs of iterations=4: the third held 2, and nothing said so.
    with pytest.warns(RuntimeWarning, match=r"ran out in epoch 2 after 2 of its iterations=4"):
        state = run(PLAIN, iter(DATA[:10]), epochs=3, iterations=4, fuse=fuse)
    assert int(state.step_state["n"]) == 10
    with warnings.catch_warnings():  # exactly enough: nothing to say
        warnings.simplefilter("error")
        run(PLAIN, iter(DATA[:12]), epochs=3, iterations=4, fuse=fuse)
