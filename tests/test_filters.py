"""Handler filters: "always", "first", every/before/after/once (on the
event's total count in the run, starting at 1, keys combined with AND) and callables;
honoured identically by the unfused and the fused loop."""

from __future__ import annotations

import numpy as np
import pytest

import fuseloop as fl
from conftest import counter_init, counter_loop, make_batches

N, EPOCHS = 12, 2
TOTAL = N * EPOCHS
DATA = make_batches(N)


def fired_counts(filter_spec, event="iteration_completed", fuse=False, epochs=EPOCHS):
    """The event's total counts at which a handler with `filter_spec` fired."""
    fired: list[int] = []

    def handler(state: fl.State) -> None:
        counts = state.event_counts[event]
        fired.append(counts["total"] if isinstance(counts, dict) else counts)

    loop = counter_loop().handle_event(event, handler, filter=filter_spec)
    loop.run(DATA, counter_init(), epochs=epochs, fuse=fuse)
    return fired


CASES = [
    ("always", list(range(1, TOTAL + 1))),
    ("first", [1]),
    ({"every": 5}, [1, 6, 11, 16, 21]),
    ({"every": 1}, list(range(1, TOTAL + 1))),
    ({"before": 4}, [1, 2, 3]),
    ({"after": 20}, [21, 22, 23, 24]),
    ({"once": 7}, [7]),
    ({"once": 30}, []),
    ({"every": 2, "after": 10}, [11, 13, 15, 17, 19, 21, 23]),
    ({"every": 3, "before": 10, "after": 2}, [4, 7]),
    ({"once": 13, "after": 12}, [13]),
    ({"once": 13, "before": 13}, []),
]


@pytest.mark.parametrize("fuse", [False, 5], ids=["unfused", "fused5"])
@pytest.mark.parametrize("event", ["iteration_started", "iteration_completed"])
@pytest.mark.parametrize("spec,expected", CASES, ids=[str(c[0]) for c in CASES])
def test_counter_filters_on_iteration_events(spec, expected, event, fuse):
    assert fired_counts(spec, event, fuse) == expected


@pytest.mark.parametrize("fuse", [False, 5], ids=["unfused", "fused5"])
def test_callable_filter_receives_the_state(fuse):
    seen: list = []

    def predicate(state: fl.State) -> bool:
        seen.append(state.iteration)
        return state.iteration % 4 == 0

    assert fired_counts(predicate, fuse=fuse) == [1, 5, 9, 13, 17, 21]
    assert seen == list(range(N)) * EPOCHS


def test_a_callable_filter_returning_a_0d_boolean_array_works():
    assert fired_counts(lambda s: np.asarray(s.iteration == 0), epochs=1) == [1]


@pytest.mark.parametrize("returned", [None, 0, "yes"], ids=["none", "int", "str"])
def test_a_callable_filter_returning_no_bool_is_refused(returned):
    """`s.iteration % 10` is truthy on every iteration but the tenth, and None never is."""

    def every_tenth(state: fl.State) -> object:
        return returned

    with pytest.raises(TypeError, match=r"filter every_tenth returned .* returns True") as caught:
        fired_counts(every_tenth)
    assert "on event 'iteration_completed'" in caught.value.__notes__[0]


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("always", [0, 1, 2, 3, 4]),
        ("first", [0]),
        ({"every": 2}, [0, 2, 4]),
        ({"before": 3}, [0, 1]),
        ({"after": 3}, [3, 4]),
        ({"once": 3}, [2]),
        ({"every": 2, "after": 1}, [2, 4]),
        (lambda s: s.epoch % 2 == 1, [1, 3]),
    ],
)
@pytest.mark.parametrize("event", ["epoch_started", "epoch_completed"])
def test_filters_on_epoch_events(spec, expected, event):
    epochs: list[int] = []
    loop = counter_loop().handle_event(event, lambda s: epochs.append(s.epoch), filter=spec)
    loop.run(make_batches(2), counter_init(), epochs=5)
    assert epochs == expected


def test_filters_count_per_run_not_per_epoch_and_restart_each_run():
    loop = counter_loop()
    fired: list = []
    loop = loop.handle_event(
        "iteration_completed", lambda s: fired.append((s.epoch, s.iteration)), filter={"once": 5}
    )
    loop.run(make_batches(3), counter_init(), epochs=2)
    loop.run(make_batches(3), counter_init(), epochs=2)
    assert fired == [(1, 1), (1, 1)]


def test_filter_of_one_handler_does_not_affect_others():
    a: list = []
    b: list = []
    loop = (
        counter_loop()
        .handle_event("iteration_completed", lambda s: a.append(s.iteration), "first")
        .handle_event("iteration_completed", lambda s: b.append(s.iteration))
    )
    loop.run(make_batches(3), counter_init())
    assert a == [0] and b == [0, 1, 2]


def test_filter_is_checked_before_a_handler_halts():
    """A halting handler whose filter does not pass lets the run continue."""
    loop = counter_loop().handle_event(
        "iteration_completed", lambda s: "halt_loop", filter={"once": 4}
    )
    state = loop.run(make_batches(6), counter_init())
    assert state.status == "halted"
    assert int(state.step_state["n"]) == 4


def test_numpy_integer_counts_are_counts_and_bools_are_not():
    assert fired_counts({"every": np.int64(3)}, "iteration_completed", False) == fired_counts(
        {"every": 3}, "iteration_completed", False
    )
    for bad in (True, 0, 2.0, np.float32(2)):
        with pytest.raises(ValueError, match="must be a positive int"):
            counter_loop().handle_event("iteration_completed", lambda s: None, {"every": bad})
