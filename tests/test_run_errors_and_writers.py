"""An exception leaving `run` carries the State reached; a handler's metric stands until
the loop next computes it (last writer wins) — both the same fused and unfused."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, counter_init, counter_loop, make_batches, trainer

DATA = make_batches(12)
FUSES = [False, 4, 5]
BASE = trainer()  # loops built from it share its compiled programs
COUNTER = counter_loop()


class SourceBroke(RuntimeError):
    pass


class HandlerBroke(Exception):
    pass


def _failing_source(epoch_fails: int, at: int) -> Any:
    """A callable source (a fresh pass per epoch) whose pass `epoch_fails` raises at batch
    `at` (passes counted from 0)."""
    passes = {"n": 0}

    def make() -> Iterator[Any]:
        this = passes["n"]
        passes["n"] += 1
        for i, batch in enumerate(DATA):
            if this == epoch_fails and i == at:
                raise SourceBroke(f"pass {this}, batch {i}")
            yield batch

    return make


# ----------------------------------------------------------------- errors carry the State
@pytest.mark.parametrize("fuse", FUSES)
def test_a_data_source_error_carries_the_state_reached(fuse: Any) -> None:
    with pytest.raises(SourceBroke) as caught:
        COUNTER.run(_failing_source(1, 7), counter_init(), epochs=3, fuse=fuse)
    state = caught.value.fuseloop_state
    assert isinstance(state, fl.State)
    assert state.epoch == 1 and list(state.history) == [0]
    # Every batch pulled before the failing one was stepped and replayed, as unfused: a
    # chunk the error cut short runs before the error is raised.
    steps = int(np.asarray(state.step_state["n"]))
    completed = state.event_counts["iteration_completed"]["total"]
    assert steps == completed == 12 + 7
    assert state.iteration == 6


@pytest.mark.parametrize("fuse", FUSES)
def test_a_handler_error_carries_the_state_and_it_resumes(fuse: Any, tmp_path: Any) -> None:
    def explode(state: fl.State) -> None:
        if state.epoch == 1 and state.iteration == 5:
            raise HandlerBroke("no")

    loop = BASE.handle_event("iteration_completed", explode)
    with pytest.raises(HandlerBroke) as caught:
        loop.run(DATA, epochs=3, fuse=fuse)
    state = caught.value.fuseloop_state
    assert state.epoch == 1 and state.iteration == 5 and list(state.history) == [0]
    assert state.event_counts["iteration_completed"]["total"] == 12 + 6
    # The step state is whole (not donated) and resumable: save, load, run to the end.
    fl.save_state(state, tmp_path / "s")
    resumed = BASE.run(DATA, fl.load_state(tmp_path / "s"), epochs=3, fuse=fuse)
    assert sorted(resumed.history) == [0, 1, 2]


def test_a_handler_error_keeps_the_last_completed_step_unfused() -> None:
    def explode(state: fl.State) -> None:
        if state.epoch == 1 and state.iteration == 5:
            raise HandlerBroke("no")

    with pytest.raises(HandlerBroke) as caught:
        BASE.handle_event("iteration_completed", explode).run(DATA, epochs=2)
    first = BASE.run(DATA, epochs=1)
    reference = BASE.run(DATA[:6], first, epochs=2)  # epoch 1: six steps
    assert_tree_equal(caught.value.fuseloop_state.step_state, reference.step_state)


def test_a_fused_handler_error_keeps_the_whole_chunk_it_ran_in() -> None:
    def explode(state: fl.State) -> None:
        if state.epoch == 1 and state.iteration == 5:
            raise HandlerBroke("no")

    loop = COUNTER.handle_event("iteration_completed", explode)
    with pytest.raises(HandlerBroke) as caught:
        loop.run(DATA, counter_init(), epochs=2, fuse=4)
    state = caught.value.fuseloop_state
    # The chunk holding iteration 5 (4..7) ran whole; the next one was never launched.
    assert int(np.asarray(state.step_state["n"])) == 12 + 8
    assert state.stats["dispatches"] == 3 + 2


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_a_second_signal_raises_keyboard_interrupt_with_the_state() -> None:
    def interrupt_twice(state: fl.State) -> None:
        if state.epoch == 1 and state.iteration == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    loop = COUNTER.handle_event("iteration_completed", interrupt_twice)
    with pytest.raises(KeyboardInterrupt) as caught:
        loop.run(DATA, counter_init(), epochs=3)
    assert signal.getsignal(signal.SIGINT) is before
    state = caught.value.fuseloop_state
    assert state.epoch == 1 and list(state.history) == [0]
    assert int(np.asarray(state.step_state["n"])) == 12 + 3


def test_an_error_before_the_first_step_carries_a_state_too() -> None:
    with pytest.raises(ValueError) as caught:
        BASE.run([], epochs=2)
    state = caught.value.fuseloop_state
    assert state.history == {} and state.step_state is None


# ----------------------------------------------------------------- last writer wins
def _writer(at: Any, value: float = 123.0, key: str = "loss") -> Any:
    def write(state: fl.State) -> Any:
        if at(state):
            return "continue", state.replace(metrics={**state.metrics, key: value})
        return None

    return write


def _runs(loop: fl.Loop) -> list[fl.State]:
    return [loop.run(DATA, epochs=2, fuse=fuse) for fuse in FUSES]


def _same(states: list[fl.State]) -> None:
    for other in states[1:]:
        assert other.history == states[0].history
        assert other.metrics == states[0].metrics


def test_a_metric_written_at_the_epochs_last_iteration_stands_in_history() -> None:
    last = _writer(lambda s: s.iteration == len(DATA) - 1)
    states = _runs(BASE.handle_event("iteration_completed", last))
    _same(states)
    assert all(states[0].history[e]["loss"] == 123.0 for e in (0, 1))
    assert states[0].metrics["loss"] == 123.0


def test_a_metric_written_earlier_is_replaced_when_the_loop_computes_it_again() -> None:
    middle = _writer(lambda s: s.iteration == 5)
    plain = BASE.run(DATA, epochs=2)
    states = _runs(BASE.handle_event("iteration_completed", middle))
    _same(states)
    assert states[0].history == plain.history


def test_a_metric_written_at_the_last_iteration_started_is_replaced() -> None:
    # The last step runs after iteration_started: the loop computes the loss again.
    started = _writer(lambda s: s.iteration == len(DATA) - 1)
    plain = BASE.run(DATA, epochs=2)
    states = _runs(BASE.handle_event("iteration_started", started))
    _same(states)
    assert states[0].history == plain.history


def test_a_metric_written_at_iteration_completed_stands_at_the_next_iteration_started() -> None:
    """No step runs between them: the next iteration_started saw the loop's loss again."""
    seen: list[Any] = []
    loop = BASE.handle_event("iteration_completed", _writer(lambda s: s.iteration == 3))
    loop = loop.handle_event(
        "iteration_started", lambda s: seen.append(s.metrics["loss"]) if s.iteration == 4 else None
    )
    _same(_runs(loop))
    assert seen == [123.0] * 2 * len(FUSES)


def test_a_new_metric_a_handler_writes_stays() -> None:
    extra = _writer(lambda s: s.iteration == 3, 7.0, key="extra")
    states = _runs(BASE.handle_event("iteration_completed", extra))
    _same(states)
    assert all(states[0].history[e]["extra"] == 7.0 for e in (0, 1))


def test_epoch_started_writes_stand_until_the_first_step() -> None:
    states = _runs(BASE.handle_event("epoch_started", _writer(lambda s: True)))
    _same(states)
    assert states[0].history == BASE.run(DATA, epochs=2).history


# ----------------------------------------------------------------- halts roll back exactly
def _halt_at(epoch: int, iteration: int) -> Any:
    def halt(state: fl.State) -> Any:
        return "halt_loop" if (state.epoch, state.iteration) == (epoch, iteration) else None

    return halt


def test_a_fused_halt_keeps_exactly_its_chunk_although_the_next_was_launched() -> None:
    # fuse=4, halt at iteration 5 of epoch 1: the chunk 4..7 ran, the one launched ahead
    # while it was replayed is undone.
    state = BASE.handle_event("iteration_completed", _halt_at(1, 5)).run(DATA, epochs=3, fuse=4)
    assert state.status == "halted" and list(state.history) == [0]
    first = BASE.run(DATA, epochs=1)
    reference = BASE.run(DATA[:8], first, epochs=2)
    assert_tree_equal(state.step_state, reference.step_state)
    assert state.stats["dispatches"] == 3 + 2


def test_a_resident_fused_halt_gives_back_its_place_in_the_epoch() -> None:
    x = np.concatenate([b[0] for b in DATA])
    y = np.concatenate([b[1] for b in DATA])
    source = fl.data.arrays(x, y, batch_size=len(DATA[0][0]), seed=1, device=True)
    host = fl.data.arrays(x, y, batch_size=len(DATA[0][0]), seed=1)
    loop = BASE.handle_event("iteration_completed", _halt_at(1, 5))
    resident = loop.run(source, epochs=3, fuse=4)
    plain = loop.run(host, epochs=3, fuse=4)
    assert_tree_equal(resident.step_state, plain.step_state)
    assert resident.stats["dispatches"] == plain.stats["dispatches"] == 5
    # The source is reusable: a fresh run over it matches the host source again.
    assert_tree_equal(
        BASE.run(source, epochs=2, fuse=4).step_state, BASE.run(host, epochs=2, fuse=4).step_state
    )
