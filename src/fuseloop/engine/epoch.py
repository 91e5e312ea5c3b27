"""The epoch loop: one loop over a feed's chunks, fused or unfused (docs/design.md §1).

    next chunk ──► (live: iteration_started) ──► launch ──► replay ──► halt? ──► next

While chunk n runs, the feed may prepare chunk n+1 (`feed.ahead`). When replaying chunk n
will wait for its records (a handler fires in it), chunk n+1 is launched first, so the
device keeps working while the host replays; a halt (or an error) in chunk n then rolls the
carry back to a packed copy taken before that launch, so the halt still takes effect at
the end of chunk n (docs/design.md §6).
"""

from __future__ import annotations

from typing import Any

from .._events import CONTINUE
from .replay import ChunkResult, EpochReplay

__all__ = ["EpochLoop"]


class EpochLoop:
    """Runs the epochs of one run over one feed and one carry."""

    def __init__(self, feed: Any, carry: Any, handoff: Any, reads: Any, guard: bool, signals: Any):
        self.feed, self.carry, self.handoff = feed, carry, handoff
        self.reads, self.guard, self.signals = reads, guard, signals
        # Launching ahead needs the guard off: the guard's flag is read from the chunk's
        # own carry, which the launch ahead would donate.
        self.speculate = not guard
        self.latest: Any = None  # the State reached within an epoch (for an error's report)
        self.replay: EpochReplay | None = None
        # Launched, not yet replayed; the first is a chunk in which a handler fires, and
        # `rollback` (the packed carry after it, the feed's place, launches since) undoes
        # everything launched after it.
        self.queue: list[ChunkResult] = []
        self.rollback: tuple[Any, Any] | None = None
        self.dropped = 0

    @property
    def _replay(self) -> EpochReplay:
        """The epoch's replay (set by `run` before anything is launched)."""
        if self.replay is None:
            raise RuntimeError("EpochLoop: no epoch is running")
        return self.replay

    def run(self, state: Any, iterator: Any, bound: int | None) -> tuple[str, Any]:
        """Steps one epoch: `(status, state)`, `state.iteration` the last one fired."""
        self.replay = replay = EpochReplay(self.handoff, self.carry, self.reads, self.guard)
        feed = self.feed
        feed.begin(state.epoch, iterator, bound, replay.record or self.guard)
        self.latest = state
        try:
            status, state, last, current = self._start(state, feed.next(0), 0)
            while current is not None:
                status, state, last, current = self._step(state, current, last)
        finally:
            if self.rollback is not None:  # an error left chunks launched ahead
                self._drop()
            self.queue = []
            feed.end()
        self.latest = None  # the epoch is over: the run holds its State again
        return status, state.replace(iteration=last)

    def _start(
        self, state: Any, prepared: Any, last: int
    ) -> tuple[str, Any, int, ChunkResult | None]:
        """Launches `prepared` (None: the epoch is over); a live step's
        `iteration_started` fires first, and may halt before the launch.
        """
        if prepared is None:
            return CONTINUE, state, last, None
        if self.feed.live:
            last = prepared.first
            status, state = self._replay.started_live(state, prepared.first)
            if status != CONTINUE:
                return status, state, last, None
        return CONTINUE, state, last, self._launch(prepared)

    def _launch(self, prepared: Any) -> ChunkResult:
        if self.rollback is not None:
            self.dropped += 1  # undone if the chunk the rollback is for halts
        return self.feed.launch(self.carry, prepared)

    def _step(
        self, state: Any, current: ChunkResult, last: int
    ) -> tuple[str, Any, int, ChunkResult | None]:
        """Replays `current` (or queues it) and launches the next chunk:
        `(status, state, last, next)`.
        """
        feed = self.feed
        nxt, failed = None, None
        if feed.ahead and not current.exhausted:
            try:  # Overlap: the host prepares the next chunk while the device runs this one.
                nxt = feed.next(current.end)
            except Exception as error:  # noqa: BLE001 - re-raised below, after the replay
                # A batch pulled ahead failed: the steps already run are replayed first,
                # and the error surfaces only where the unfused loop would reach that batch.
                failed = error
        lag = sum(chunk.n for chunk in self.queue)
        fires = self._replay.waits_for(current, lag)
        self.queue.append(current)
        if nxt is not None and self.speculate and fires and not current.done():
            # Replaying `current` would wait for the device: defer it, launching on.
            status, state, last = self._replay_queue(state, last, len(self.queue) - 1)
            if status != CONTINUE or self.signals.requested:
                return self._stop(state, last, status)
            self.rollback, self.dropped = (self.carry.snapshot(), feed.mark()), 0
            return CONTINUE, state, last, self._launch(nxt)
        if nxt is not None and self.rollback is not None and not fires:
            return self._start(state, nxt, last)  # replayed after the queue's first chunk
        status, state, last = self._replay_queue(state, last, len(self.queue))
        if status != CONTINUE or self.signals.requested:
            return status, state, last, None
        if failed is not None:
            raise failed
        if not feed.ahead and not current.exhausted:
            nxt = feed.next(current.end)
        return self._start(state, nxt, last)

    def _replay_queue(self, state: Any, last: int, count: int) -> tuple[str, Any, int]:
        """Replays the first `count` queued chunks in order, their records read together
        (with the carry's accumulators when they end the epoch's launches). A halt or an
        error in the first one drops what was launched after it.
        """
        chunks, self.queue = self.queue[:count], self.queue[count:]
        if not chunks:
            return CONTINUE, state, last
        replay, records = self._replay, [None] * count
        if self.speculate and any(replay.waits_for(c, lag) for c, lag in _lags(chunks)):
            ends = chunks[-1].exhausted and not self.queue
            records, acc = replay.read(chunks, self.carry.tail["acc"] if ends else None)
            if ends:
                self.carry.preset_metrics(acc)
        for i, chunk in enumerate(chunks):
            try:
                status, state, last = replay.chunk(state, chunk, records[i])
            except BaseException:
                if self.rollback is not None:
                    self._drop()
                raise
            self.latest = state
            if status != CONTINUE:  # the first chunk, or the last (nothing fires between)
                if self.rollback is not None:
                    self._drop()
                return status, state, last
            self.rollback = None  # the chunk it was for went through
        return status, state, last

    def _stop(self, state: Any, last: int, status: str) -> tuple[str, Any, int, None]:
        """Stops the epoch after the queue was replayed: a halt, or a signal (the chunks
        still launched are replayed first, so the carry and the events agree).
        """
        if status == CONTINUE:
            status, state, last = self._replay_queue(state, last, len(self.queue))
        return status, state, last, None

    def _drop(self) -> None:
        """Drops the chunks launched after the rollback's chunk: the carry and the feed go
        back to the end of that chunk.
        """
        assert self.rollback is not None
        snapshot, mark = self.rollback
        self.carry.restore(snapshot, self.dropped)
        self.feed.rewind(mark)
        self.rollback, self.dropped, self.queue = None, 0, []


def _lags(chunks: list[ChunkResult]) -> list[tuple[ChunkResult, int]]:
    """Each chunk with the steps queued before it."""
    out, lag = [], 0
    for chunk in chunks:
        out.append((chunk, lag))
        lag += chunk.n
    return out
