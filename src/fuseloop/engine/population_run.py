"""The host side of a population run: its record, members that halt, and the metrics of
members that no longer run (docs/design.md §8).

`engine/run.py` calls it at three points: the run's start (the record, and the members a
resumed State had halted are frozen again), an epoch's end (members whose guard tripped
halt; halted members' metrics read NaN), and after `epoch_completed` (members a handler
halted, e.g. a per-member `early_stop`, are frozen; the run ends when none is left).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._population import halt_members, population_record
from .._state import POPULATION_KEY, State
from .._warn import warn

__all__ = ["PopulationHost"]


class PopulationHost:
    """Keeps a population run's record and its carry's `active` mask in step."""

    def __init__(self, population: Any, carry: Any, reads: Any, guard: bool):
        self.population, self.carry, self.reads, self.guard = population, carry, reads, guard
        self.applied = np.zeros(population.size, bool)  # members frozen on the device

    def start(self, state: State) -> State:
        """The State with its record (a fresh one for a new population), and the carry with
        the members it had halted frozen.
        """
        if POPULATION_KEY not in state.handler_metadata:
            record = self.population.record()
            state = state.replace(
                handler_metadata={**state.handler_metadata, POPULATION_KEY: record}
            )
        self.carry.reset_metrics()
        self._freeze(state)
        return state

    def halted(self, state: State) -> np.ndarray:
        return np.asarray(population_record(state)["halted"], bool)

    def epoch_end(
        self, state: State, epoch: int, active: np.ndarray | None = None
    ) -> tuple[State, bool]:
        """Members whose guard tripped this epoch halt (their history ends at the epoch
        before); halted members' metrics read NaN. Returns `(state, all halted)`.

        `active` (already on the host) is which members were active at the epoch's end,
        before its handlers (a multi-epoch dispatch's record); by default the carry's.
        """
        if self.guard:
            if active is None:
                # Host read: which members are still active, once per epoch (guard on only).
                active = np.asarray(self.reads.get(self.carry.tail["active"]), bool)
            tripped = ~active & ~self.halted(state)
            if tripped.any():
                state = halt_members(state, tripped, epoch - 1, halted_in=epoch)
                self.applied |= tripped
                _warn_nonfinite(np.flatnonzero(tripped), epoch)
        record = population_record(state)
        gone = np.array(
            [
                h and (last is None or last < epoch)
                for h, last in zip(record["halted"], record["last_epoch"], strict=True)
            ],
            bool,
        )
        if gone.any():
            metrics = {k: _masked(v, gone) for k, v in state.metrics.items()}
            state = state.replace(metrics=metrics)
        return state, bool(self.halted(state).all())

    def after_handlers(self, state: State) -> bool:
        """Freezes the members a handler halted; True when every member has halted."""
        self._freeze(state)
        return bool(self.halted(state).all())

    def _freeze(self, state: State) -> None:
        halted = self.halted(state)
        newly = halted & ~self.applied
        if newly.any():
            self.carry.stop_members(newly)
            self.applied |= newly


def _masked(value: Any, gone: np.ndarray) -> Any:
    if isinstance(value, np.ndarray) and value.shape == gone.shape:
        return np.where(gone, np.nan, value)
    return value


def _warn_nonfinite(members: np.ndarray, epoch: int) -> None:
    warn(
        f"terminate_on_nan: the loss of population members {members.tolist()} became "
        f"non-finite in epoch {epoch}; each was frozen with its parameters from before that "
        f"step and "
        + (f"its history ends at epoch {epoch - 1}" if epoch > 0 else "it has no history"),
        RuntimeWarning,
    )
