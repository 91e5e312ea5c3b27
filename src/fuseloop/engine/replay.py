"""Replay: a launched chunk's iteration events, fired on the host in unfused order.

A chunk's `ChunkResult` holds only device values. `EpochReplay.chunk` decides from the
event counters at which iterations some handler fires; only then does it read the chunk's
records (one host read per chunk) and build a State for those iterations. The others
advance the counters in bulk. A live step (the unfused loop) is a chunk of one whose
`iteration_started` already fired before its launch, with the live step state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._events import CONTINUE, HALT_LOOP, Event
from .._state import NONFINITE_KEY
from .._warn import warn

__all__ = [
    "ChunkResult",
    "EpochReplay",
    "mark_nonfinite",
    "show_nonfinite_halt",
    "warn_nonfinite",
]

_STARTED, _COMPLETED = Event.ITERATION_STARTED, Event.ITERATION_COMPLETED
Metrics = Callable[[], dict[str, float]]


@dataclass(frozen=True)
class ChunkResult:
    """A launched chunk, not yet read.

    Attributes:
        first: The epoch iteration of its first step.
        n: Its live steps.
        records: Per-slot accumulators on the device (None for a live step, whose metrics
            are the carry's).
        n_run: Steps the device loop ran, on the device (None for a live step).
        exhausted: Nothing follows it in the epoch.
        nonfinite: The guard's flag after the chunk, on the device (None without the guard
            or for a live step).
    """

    first: int
    n: int
    records: Any
    n_run: Any
    exhausted: bool
    nonfinite: Any = None

    @property
    def end(self) -> int:
        return self.first + self.n

    @property
    def live(self) -> bool:
        return self.records is None

    def done(self) -> bool:
        """Whether the device has finished this chunk (asked without waiting)."""
        is_ready = getattr(self.n_run, "is_ready", None)
        return is_ready is not None and bool(is_ready())


def _no_metrics() -> dict[str, float]:
    return {}


class EpochReplay:
    """Fires one epoch's iteration events, chunk by chunk.

    Attributes:
        previous: The metrics as of the iteration before the next one (for its
            `iteration_started`), read only if a handler needs them.
        steps: Steps committed so far this epoch.
        merged_through: The last step whose metrics a firing merged into `state.metrics`
            (-1: none), so the epoch's end knows whether a handler wrote after the loop
            last computed them (last writer wins).
    """

    def __init__(self, handoff: Any, carry: Any, reads: Any, guard: bool, ahead: bool = False):
        self.handoff, self.bus, self.carry, self.reads = handoff, handoff.bus, carry, reads
        self.guard = guard
        self.record = self.bus.has_iteration_handlers
        # The guard's flags are read once, at the epoch's end (`settle`), where no
        # iteration handler fires and the feed may pull past a halt (`ahead`): a chunk
        # after a non-finite step runs no step (the flag stays set in the carry), so the
        # host need not wait for each chunk before it launches the next.
        self.defer_guard = guard and ahead and not self.record
        self.pending: list[ChunkResult] = []
        self.previous: Metrics = _no_metrics
        self.steps = 0
        self.merged_through = -1
        self._firing_key: tuple[int, int, int] | None = None
        self._firing_offsets: list[int] = []

    def waits_for(self, result: ChunkResult) -> bool:
        """Whether replaying `result` reads its records (some handler fires in it)."""
        return self.record and not result.live and bool(self._firing(result.n))

    def _firing(self, n: int) -> list[int]:
        """The offsets of the next `n` iterations at which a handler fires (from counters;
        remembered until the counters move).
        """
        key = (self.bus.total[_STARTED], self.bus.total[_COMPLETED], n)
        if key != self._firing_key:
            self._firing_key, self._firing_offsets = key, self.bus.firing_offsets(n)
        return self._firing_offsets

    def _fire(
        self, event: Event, state: Any, i: int, metrics: Metrics, live: bool, stamp: int
    ) -> tuple[str, Any]:
        """Fires `event` with the metrics of step `stamp` merged into the State's, unless
        an earlier firing merged them already (an `iteration_started` after the previous
        step's `iteration_completed`): what its handlers wrote since stands (last writer
        wins), as the loop has computed nothing new."""
        if stamp <= self.merged_through:
            metrics = _no_metrics
        status, fired = self.handoff.fire_iteration(event, state, i, metrics, live)
        if fired is not state:
            self.merged_through = stamp
        return status, fired

    # ----------------------------------------------------------------- live steps
    def started_live(self, state: Any, i: int) -> tuple[str, Any]:
        """`iteration_started` of a live step, before its launch."""
        return self._fire(_STARTED, state, i, self.carry.metrics, True, self.steps - 1)

    def _live(self, state: Any, result: ChunkResult) -> tuple[str, Any, int]:
        i = result.first
        if self.guard and self.carry.nonfinite():
            return HALT_LOOP, mark_nonfinite(state, i), i
        self.steps += 1
        try:
            status, state = self._fire(
                _COMPLETED, state, i, self.carry.metrics, True, self.steps - 1
            )
        finally:  # the step completed: the bar counts it even when a handler raised
            self.bus.advance(1, self.carry.metrics_if_read)
        return status, state, i

    # ----------------------------------------------------------------- chunks
    def chunk(self, state: Any, result: ChunkResult) -> tuple[str, Any, int]:
        """Fires `result`'s iteration events: `(status, state, last iteration fired)`."""
        if result.live:
            return self._live(state, result)
        first, n = result.first, result.n
        firing = self._firing(n) if self.record else []
        if (not self.guard or self.defer_guard) and not firing:
            if self.defer_guard:
                self.pending.append(result)
            self.bus.skip_iterations(n)
            self.bus.advance(n, None)
            self.steps += n
            if self.record:
                self.previous = self._lazy(result.records, n - 1, on_device=True)
            return CONTINUE, state, first + n - 1
        # Host read: once per chunk, the records (with the guard, also the steps run and
        # its flag; without it every live step ran). Each leaf read costs the host a few
        # microseconds, so nothing else is read.
        wanted = {"records": result.records}
        if self.guard:
            wanted.update(n_run=result.n_run, nonfinite=result.nonfinite)
        host = self.reads.get(wanted)
        good = int(host["n_run"]) - 1 if self.guard and bool(host["nonfinite"]) else n
        return self._fire_chunk(state, first, n, good, firing, host["records"])

    def settle(self, state: Any, last: int, tail: Any) -> tuple[str, Any, int]:
        """The guard's verdict on the chunks replayed without reading it: one host read
        of the flag (sticky in the epoch's `tail`) and of their steps run; where one met a
        non-finite step, the counters go back to that step (its iteration started, never
        completed) and the loop halts."""
        pending, self.pending = self.pending, []
        if not pending:
            return CONTINUE, state, last
        # Host read: once per epoch, the guard's flag (in the epoch's own `tail`) and every
        # deferred chunk's steps run.
        host = self.reads.get({"nonfinite": tail["nonfinite"], "n_run": [r.n_run for r in pending]})
        if not bool(host["nonfinite"]):
            return CONTINUE, state, last
        bad, good = _first_nonfinite([r.n for r in pending], [int(k) for k in host["n_run"]])
        counted = sum(r.n for r in pending[bad:])  # as if they had run whole
        self.bus.skip_iterations(good - counted)
        self.bus.advance(good - counted, None)  # the progress bar counted them too
        self.steps += good - counted
        at = pending[bad].first + good
        _, state = self._fire(_STARTED, state, at, self.previous, False, self.steps - 1)
        return HALT_LOOP, mark_nonfinite(state, at), at

    def _fire_chunk(
        self, state: Any, first: int, n: int, good: int, firing: list[int], records: Any
    ) -> tuple[str, Any, int]:
        at = (lambda j: self._lazy(records, j)) if self.record else (lambda j: _no_metrics)
        done = 0  # offsets whose events have been accounted for
        for j in (j for j in firing if j < good):
            self.bus.skip_iterations(j - done)
            before = self.previous if j == 0 else at(j - 1)
            self.previous, done = at(j), j + 1
            shown = (j, before)  # a halt or an error here: iteration j never completed
            try:
                status, state = self._fire(
                    _STARTED, state, first + j, before, False, self.steps + j - 1
                )
                if status == CONTINUE:
                    shown = (j + 1, self.previous)
                    status, state = self._fire(
                        _COMPLETED, state, first + j, self.previous, False, self.steps + j
                    )
            except BaseException:
                self._observe(*shown)  # the bar's "stopped" line counts what completed
                raise
            if status != CONTINUE:
                self.steps += good  # the device ran the whole chunk
                self._observe(*shown)
                return status, state, first + j
        self.bus.skip_iterations(good - done)
        self.steps += good
        if good:
            self.previous = at(good - 1)
        # The progress bar counts the steps that completed, as the unfused loop does.
        self._observe(good, self.previous)
        if good < n:  # the non-finite step: its iteration started, then the loop halts
            _, state = self._fire(
                _STARTED, state, first + good, self.previous, False, self.steps - 1
            )
            return HALT_LOOP, mark_nonfinite(state, first + good), first + good
        return CONTINUE, state, first + n - 1

    def _observe(self, completed: int, metrics: Metrics) -> None:
        """Tells the progress bar that `completed` more iterations completed, with the
        metrics after the last of them (read only where a bar is shown)."""
        if self.bus.observed:
            self.bus.advance(completed, metrics() if self.record and completed else None)

    def _lazy(self, records: Any, j: int, on_device: bool = False) -> Metrics:
        """Metrics of slot `j` of a chunk's records, built (and, for records still on the
        device, read) only when first asked for.
        """
        cache: dict[str, Any] = {}

        def metrics() -> dict[str, float]:
            if "value" not in cache:
                # Host read (records still on the device only): an iteration_started
                # handler needs the previous chunk's last metrics.
                host = self.reads.get(records) if on_device else records
                cache["value"] = self.reads.record_metrics(host, j)
            return cache["value"]

        return metrics


def _first_nonfinite(live: list[int], ran: list[int]) -> tuple[int, int]:
    """`(chunk, steps before it)` of the non-finite step among chunks of `live` steps that
    ran `ran` steps each. The loop counts the bad step in `n_run` and stops there; a
    chunk launched after it runs none (the flag is already set when it starts).
    """
    for k, (n, r) in enumerate(zip(live, ran, strict=True)):
        if r < n:
            return (k, r - 1) if r > 0 or k == 0 else (k - 1, live[k - 1] - 1)
    return len(live) - 1, live[-1] - 1


def mark_nonfinite(state: Any, iteration: int) -> Any:
    """Notes in the State where the loss went non-finite (the run warns and halts)."""
    where = {"epoch": state.epoch, "iteration": iteration}
    return state.replace(
        iteration=iteration, handler_metadata={**state.handler_metadata, NONFINITE_KEY: where}
    )


def show_nonfinite_halt(bus: Any, state: Any) -> None:
    """At a halt on a non-finite loss, the display's last line gets the good steps'
    metrics, which an unfused loop would not have read by itself; they are the State's in
    every mode (no read here: the State holds them)."""
    if state.handler_metadata.get(NONFINITE_KEY) is not None:
        bus.advance(0, state.metrics)


def warn_nonfinite(state: Any) -> None:
    """The warning of a run the guard (`terminate_on_nan`) halted."""
    where = state.handler_metadata[NONFINITE_KEY]
    warn(
        f"terminate_on_nan: the loss became non-finite at epoch {where['epoch']}, "
        f"iteration {where['iteration']}; that step was not applied and the loop halted "
        f"with the parameters from before it",
        RuntimeWarning,
    )
