"""Property: over loop configurations, the fused loop equals the unfused loop bitwise.

Drawn: the chunk size, epochs, the per-epoch iteration bound, the data length, and (with
`fuse=1`, which halts on the exact iteration) a handler that halts the loop at a random
iteration. Compared: params and the whole step state, history, metrics, event counts,
status, and the (epoch, iteration) the run stopped at.
"""

from __future__ import annotations

from typing import Any

import pytest

import fuseloop as fl
from conftest import assert_runs_identical, make_batches, tiny_mlp

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

POOL = make_batches(10)


class HaltAt:
    """Halts the loop at the `at`-th iteration_completed of a run (None: never).

    A mutable handler, so one compiled Loop serves every drawn example.
    """

    def __init__(self) -> None:
        self.at: int | None = None

    def __call__(self, state: fl.State) -> str | None:
        total = state.event_counts["iteration_completed"]["total"]
        return "halt_loop" if total == self.at else None


HALT = HaltAt()
_LOOPS: dict[str, fl.Loop] = {}


def loop_for(halting: bool) -> fl.Loop:
    """Module-level cache: each Loop compiles once per chunk size, not once per example."""
    key = "halting" if halting else "plain"
    if key not in _LOOPS:
        loop = fl.trainer(tiny_mlp(), "sparse_categorical_cross_entropy", "adam")
        loop = loop.metric("accuracy")
        if halting:
            loop = loop.handle_event("iteration_completed", HALT)
        _LOOPS[key] = loop
    return _LOOPS[key]


@st.composite
def configurations(draw: Any) -> dict[str, Any]:
    n_data = draw(st.integers(1, len(POOL)))
    epochs = draw(st.integers(1, 3))
    iterations = draw(st.one_of(st.none(), st.integers(1, n_data + 2)))
    halting = draw(st.booleans())
    fuse = 1 if halting else draw(st.sampled_from([2, 3, 4]))
    per_epoch = min(n_data, iterations or n_data)
    halt_at = draw(st.integers(1, per_epoch * epochs)) if halting else None
    return {
        "n_data": n_data,
        "epochs": epochs,
        "iterations": iterations,
        "fuse": fuse,
        "halting": halting,
        "halt_at": halt_at,
    }


@settings(deadline=None, max_examples=25, derandomize=True)
@given(config=configurations())
def test_fused_equals_unfused_bitwise(config):
    loop = loop_for(config["halting"])
    HALT.at = config["halt_at"]
    data = POOL[: config["n_data"]]
    options = {"epochs": config["epochs"], "iterations": config["iterations"]}
    unfused = loop.run(data, fuse=False, **options)
    fused = loop.run(data, fuse=config["fuse"], **options)
    assert_runs_identical(fused, unfused)
    assert (fused.epoch, fused.iteration) == (unfused.epoch, unfused.iteration)
    expected_status = "halted" if config["halt_at"] is not None else "completed"
    assert unfused.status == expected_status
    if config["halt_at"] is not None:
        assert unfused.event_counts["iteration_completed"]["total"] == config["halt_at"]
