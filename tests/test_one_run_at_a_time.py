"""A handler that keeps its run's state serves one run at a time (engine/serving.py).

`early_stop` keeps its best epoch's step state on itself, `checkpoint` its numbering, the
writers their files: two runs sharing one of them at once (one Loop run from two threads,
or a run started from its own handler) returned one run's last params as the other's best.
A second run is refused while the first holds the handler; other Loops run side by side.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, make_batches, trainer

BATCHES = make_batches(n=6)


@contextlib.contextmanager
def held_mid_run(loop: fl.Loop, data: list) -> Iterator[dict]:
    """Runs `loop` over `data` in another thread, held inside its first `epoch_completed`
    for the `with` body; yields the dict that gets its `state` (or `error`) once it
    returns, after the body let it go."""
    entered, release, out = threading.Event(), threading.Event(), {}

    def hold(state: fl.State) -> None:
        if not entered.is_set():
            entered.set()
            assert release.wait(60), "the test never let the run go"

    def work() -> None:
        try:
            out["state"] = loop.handle_event("epoch_completed", hold).run(data, epochs=2)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            out["error"] = error

    # Named as the test's own thread is: the holder is told apart by its identity.
    thread = threading.Thread(target=work, name=threading.current_thread().name)
    thread.start()
    try:
        assert entered.wait(60)
        yield out
    finally:
        release.set()
        thread.join(60)
    assert "error" not in out, out.get("error")


def _early_stopping() -> fl.Loop:
    return trainer(optimizer="sgd").early_stop("loss", patience=2, restore_best=True)


def test_a_second_run_of_a_loop_whose_early_stop_is_serving_a_run_is_refused():
    loop = _early_stopping()
    refused = pytest.raises(RuntimeError, match="early_stop is serving a run in another thread")
    with held_mid_run(loop, BATCHES) as first, refused:
        loop.run(BATCHES, epochs=2)
    # The first run went on undisturbed: the same as the run alone.
    alone = _early_stopping().run(BATCHES, epochs=2)
    assert_tree_equal(first["state"].step_state, alone.step_state, "first run")
    # Its handler is free again once it returned.
    again = loop.run(BATCHES, epochs=2)
    assert_tree_equal(again.step_state, alone.step_state, "the run after it")


def test_a_run_started_from_its_own_handler_is_refused_and_the_loop_runs_again_after():
    loop = _early_stopping()
    inner: list[BaseException] = []

    def nested(state: fl.State) -> None:
        with pytest.raises(RuntimeError, match="a run of this thread that has not returned"):
            loop.run(BATCHES, epochs=1)
        inner.append(RuntimeError("refused"))

    state = loop.handle_event("epoch_completed", nested, {"once": 1}).run(BATCHES, epochs=2)
    assert state.status == "completed" and len(inner) == 1


def test_a_run_that_raised_lets_its_handlers_go():
    loop = _early_stopping()

    def fail(state: fl.State) -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        loop.handle_event("epoch_completed", fail).run(BATCHES, epochs=2)
    assert loop.run(BATCHES, epochs=2).status == "completed"


def test_one_handler_object_attached_to_two_loops_serves_one_run_at_a_time(tmp_path):
    writer = fl.handlers.writers.CSVWriter(tmp_path / "metrics.csv")
    second = trainer(optimizer="sgd").handle_event("epoch_completed", writer)
    refused = pytest.raises(RuntimeError, match="CSVWriter is serving a run in another thread")
    with held_mid_run(trainer().handle_event("epoch_completed", writer), BATCHES) as first, refused:
        second.run(BATCHES, epochs=2)
    assert first["state"].status == "completed"


def test_loops_without_such_handlers_run_in_two_threads_at_once():
    # early_stop without restore_best keeps its record in the State, nothing on itself.
    loop, other_data = trainer().early_stop("loss", patience=5), make_batches(n=6, seed=1)
    with held_mid_run(loop, BATCHES) as first:
        beside = loop.run(other_data, epochs=2)  # while the first is held
    alone = trainer().early_stop("loss", patience=5).run(BATCHES, epochs=2)
    other = trainer().early_stop("loss", patience=5).run(other_data, epochs=2)
    assert_tree_equal(first["state"].step_state, alone.step_state, "first run")
    assert_tree_equal(beside.step_state, other.step_state, "run beside it")
    assert not np.array_equal(
        np.asarray(first["state"].history[1]["loss"]), np.asarray(beside.history[1]["loss"])
    )


def test_the_refusal_names_each_handler_by_its_builder_and_what_it_keeps(tmp_path):
    loop = _early_stopping().csv_log(tmp_path / "m.csv")
    with held_mid_run(loop, BATCHES), pytest.raises(RuntimeError) as refused:
        loop.run(BATCHES, epochs=2)
    message = str(refused.value)
    assert "the handlers csv_log, early_stop are serving a run in another thread" in message
    assert "csv_log: its columns; early_stop: its best epoch's step state" in message
