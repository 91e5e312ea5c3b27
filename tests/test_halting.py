"""Halting (unfused): halt_epoch, halt_loop from each level, and the `iterations` bound.

Where a halted run's parameters are checked, the reference is the same trainer run on a
callable data source that yields exactly the batches the halted run should have stepped
(the same compiled step, so the comparison is bitwise).
"""

from __future__ import annotations

import pytest

from conftest import (
    CountingGenerator,
    assert_tree_equal,
    counter_init,
    counter_loop,
    make_batches,
    record_all,
    trainer,
)

DATA = make_batches(12)


def per_epoch(*epochs):
    """A callable source yielding `epochs[e]` in epoch e (called once per epoch)."""
    calls = iter(epochs)
    return lambda: iter(next(calls))


def halt_at(epoch, iteration, status):
    return lambda s: status if (s.epoch, s.iteration) == (epoch, iteration) else None


def test_halt_epoch_from_an_iteration_handler():
    log: list = []
    loop = trainer().metric("accuracy")
    # Recorders first: the halting handler stops those registered after it.
    halted = (
        record_all(loop, log)
        .handle_event("iteration_completed", halt_at(0, 3, "halt_epoch"))
        .run(DATA, epochs=2)
    )
    reference = loop.run(per_epoch(DATA[:4], DATA), epochs=2)
    events = [(e, ep) for e, ep, _ in log if not e.startswith("iteration")]
    assert events == [
        ("started", 0),
        ("epoch_started", 0),
        ("epoch_halted", 0),
        ("epoch_started", 1),
        ("epoch_completed", 1),
        ("completed", 1),
    ]
    iterations = [(ep, i) for e, ep, i in log if e == "iteration_completed"]
    assert iterations == [(0, i) for i in range(4)] + [(1, i) for i in range(12)]
    assert halted.event_counts["epoch_halted"] == 1
    assert halted.event_counts["epoch_completed"] == 1
    assert halted.event_counts["iteration_completed"] == {"total": 16, "epoch": 12}
    assert halted.status == "completed"
    # The halted epoch is recorded in history, with its metrics over 4 iterations.
    assert sorted(halted.history) == [0, 1]
    assert halted.history == reference.history
    assert_tree_equal(halted.step_state, reference.step_state)
    assert int(halted.step_state["step"]) == 16


def test_halt_loop_from_an_iteration_handler():
    log: list = []
    loop = trainer()
    halted = (
        record_all(loop, log)
        .handle_event("iteration_completed", halt_at(1, 2, "halt_loop"))
        .run(DATA, epochs=3)
    )
    reference = loop.run(per_epoch(DATA, DATA[:3]), epochs=2)
    events = [(e, ep) for e, ep, _ in log if not e.startswith("iteration")]
    assert events == [
        ("started", 0),
        ("epoch_started", 0),
        ("epoch_completed", 0),
        ("epoch_started", 1),
        ("halted", 1),
    ]
    assert halted.status == "halted"
    assert halted.event_counts["halted"] == 1 and halted.event_counts["completed"] == 0
    assert halted.event_counts["epoch_halted"] == 0
    assert halted.event_counts["iteration_completed"] == {"total": 15, "epoch": 3}
    assert 0 in halted.history and 2 not in halted.history
    assert_tree_equal(halted.step_state, reference.step_state)


def test_halt_loop_from_epoch_completed():
    loop = counter_loop().handle_event("epoch_completed", halt_at(1, 2, "halt_loop"))
    state = loop.run(make_batches(3), counter_init(), epochs=5)
    assert state.status == "halted"
    assert sorted(state.history) == [0, 1]
    assert state.event_counts["epoch_started"] == 2
    assert state.event_counts["epoch_completed"] == 2
    assert (state.event_counts["halted"], state.event_counts["completed"]) == (1, 0)
    assert int(state.step_state["n"]) == 6


def test_halt_loop_from_started_runs_no_epoch():
    log: list = []
    loop = record_all(counter_loop(), log).handle_event("started", lambda s: "halt_loop")
    state = loop.run(make_batches(3), counter_init(), epochs=2)
    assert [e for e, *_ in log] == ["started", "halted"]
    assert state.status == "halted"
    assert int(state.step_state["n"]) == 0


@pytest.mark.parametrize("fuse", [False, 4])
@pytest.mark.parametrize("status", ["halt_loop", "halt_epoch"])
def test_a_halt_at_the_first_epoch_started_steps_nothing_of_that_epoch(status, fuse):
    # The first batch was pulled to initialise: it belongs to the first epoch's pass, so
    # the next epoch starts its own pass at its first batch, as a fresh run would.
    loop = trainer().handle_event("epoch_started", halt_at(0, 0, status))
    state = loop.run(DATA, epochs=2, fuse=fuse)
    steps = state.event_counts["iteration_completed"]["total"]
    if status == "halt_loop":
        assert state.status == "halted" and steps == 0 and state.history == {}
        return
    assert state.status == "completed" and steps == len(DATA)
    assert_tree_equal(state.params, trainer().run(DATA, epochs=1, fuse=fuse).params)


def test_halt_loop_from_iteration_started_skips_that_step():
    loop = counter_loop().handle_event("iteration_started", halt_at(0, 2, "halt_loop"))
    state = loop.run(make_batches(6), counter_init())
    assert int(state.step_state["n"]) == 2
    assert state.event_counts["iteration_started"]["total"] == 3
    assert state.event_counts["iteration_completed"]["total"] == 2
    assert state.status == "halted"


def test_final_handlers_see_the_final_status():
    seen: list = []
    loop = (
        counter_loop()
        .handle_event("halted", lambda s: seen.append(("halted", s.status)))
        .handle_event("completed", lambda s: seen.append(("completed", s.status)))
    )
    loop.run(make_batches(2), counter_init())
    loop.handle_event("iteration_completed", lambda s: "halt_loop").run(
        make_batches(2), counter_init()
    )
    assert seen == [("completed", "completed"), ("halted", "halted")]


def test_iterations_bounds_each_epoch():
    loop = trainer().metric("accuracy")
    bounded = loop.run(DATA, epochs=2, iterations=5)
    reference = loop.run(DATA[:5], epochs=2)
    assert_tree_equal(bounded.step_state, reference.step_state)
    assert bounded.history == reference.history
    assert bounded.event_counts == reference.event_counts
    assert bounded.max_iteration == 5
    assert bounded.event_counts["iteration_completed"] == {"total": 10, "epoch": 5}


def test_iterations_larger_than_the_data_is_bounded_by_the_data():
    state = counter_loop().run(make_batches(4), counter_init(), epochs=2, iterations=10)
    assert int(state.step_state["n"]) == 8
    assert state.event_counts["iteration_completed"] == {"total": 8, "epoch": 4}


def test_iterations_with_a_one_shot_iterator_consumes_across_epochs():
    source = CountingGenerator(DATA)
    loop = trainer()
    bounded = loop.run(source, epochs=2, iterations=5)
    reference = loop.run(per_epoch(DATA[:5], DATA[5:10]), epochs=2)
    assert source.pulls == 10
    assert_tree_equal(bounded.step_state, reference.step_state)


@pytest.mark.parametrize("status", ["halt_epoch", "halt_loop"])
def test_halt_returned_with_a_new_state(status):
    def handler(state):
        return status, state.replace(handler_metadata={"at": (state.epoch, state.iteration)})

    loop = counter_loop().handle_event("iteration_completed", handler, filter={"once": 2})
    state = loop.run(make_batches(4), counter_init(), epochs=2)
    assert state.handler_metadata == {"at": (0, 1)}
    expected_steps = 2 + 4 if status == "halt_epoch" else 2
    assert int(state.step_state["n"]) == expected_steps
