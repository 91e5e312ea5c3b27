"""The epoch loop: one loop over a feed's chunks, fused or unfused (docs/design.md §1).

    next chunk ──► (live: iteration_started) ──► launch ──► replay ──► halt? ──► next

While chunk n runs, the feed may prepare chunk n+1 (`feed.ahead`). When replaying chunk n
will wait for its records (a handler fires in it), chunk n+1 is launched first, so the
device keeps working while the host replays; a halt (or an error) in chunk n then rolls the
carry back to a packed copy taken before that launch, so the halt still takes effect at
the end of chunk n; chunk n+2 is prepared before the wait too, where the feed may prepare
two ahead (`feed.depth`), and dropped with n+1 (docs/design.md §6).

Where nothing can act at an epoch's end (no epoch handler, no population), the run opens
the next epoch before it reads the ending one's metrics (`open_next`): the device goes on
from one epoch's last chunk to the next epoch's first without waiting for the host
(docs/design.md §6). The guard's flag is then read from the ending epoch's own tail, and a
halt it decides rolls the opening back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._events import CONTINUE, HALT_EPOCH, HALT_LOOP, Event
from .._state import HELD_KEY, NONFINITE_KEY
from .replay import ChunkResult, EpochReplay

__all__ = ["EpochLoop"]


class EpochLoop:
    """Runs the epochs of one run over one feed and one carry."""

    def __init__(self, feed: Any, carry: Any, handoff: Any, reads: Any, guard: bool, signals: Any):
        self.feed, self.carry, self.handoff = feed, carry, handoff
        self.reads, self.guard, self.signals = reads, guard, signals
        # Launching ahead of a replay needs the guard off: a replay that reads the guard's
        # flag after every chunk (an iteration handler fires) reads it from the chunk's own
        # carry, which the launch ahead would donate. Without one, the flag is read once,
        # at the epoch's end (`EpochReplay.settle`).
        self.speculate = not guard
        self.latest: Any = None  # the State reached within an epoch (for an error's report)
        self.latest_iteration = 0  # ... and its last fired iteration (`reached`)
        self.replay: EpochReplay | None = None
        # The next epoch, opened early (`open_next`): its number and its first chunk as
        # launched (a ChunkResult), None (the epoch has no batch) or the error preparing it.
        self.opened: tuple[int, Any] | None = None
        # The next epoch the run allows to open ahead of the last chunk's replay:
        # `(epoch, iterator factory, bound)`, or None (`run`'s `ahead`).
        self.ahead: tuple[int, Callable[[], Any], int | None] | None = None
        # The chunk prepared after one launched ahead of a replay (`_step`): its first
        # iteration, the Prepared (None: the epoch is over) and the error preparing it.
        self.stashed: tuple[int, Any, BaseException | None] | None = None
        # Whether the epoch under way stopped before its end: a halt, or a signal that
        # reached it while batches were left (one after its last chunk lets it complete).
        self.cut_short = False
        # The steps of the epoch under way that the carry holds, as of the chunk last
        # replayed (a fused chunk runs whole): where a halt leaves more than the iterations
        # completed, the State says so (`mark_held`).
        self.held = 0

    @property
    def _replay(self) -> EpochReplay:
        """The epoch's replay (set by `run` before anything is launched)."""
        if self.replay is None:
            raise RuntimeError("EpochLoop: no epoch is running")
        return self.replay

    def run(
        self,
        state: Any,
        iterator: Any,
        bound: int | None,
        ahead: tuple[int, Callable[[], Any], int | None] | None = None,
    ) -> tuple[str, Any]:
        """Steps one epoch: `(status, state)`, `state.iteration` the last one fired
        (`iterator` is not used when `open_next` opened the epoch). `ahead`: the next
        epoch may open before the replay of this one's last chunk waits for it (its
        number, a factory of its iterator, its bound).
        """
        feed, opened = self.feed, self.opened
        self.opened, self.ahead, self.cut_short = None, ahead, False
        record = self.handoff.bus.has_iteration_handlers
        if opened is None:
            feed.begin(state.epoch, iterator, bound, record or self.guard)
        self.replay = replay = EpochReplay(
            self.handoff, self.carry, self.reads, self.guard, ahead=feed.ahead
        )
        self.latest, self.latest_iteration = state, state.iteration
        self.held = 0  # the epoch's steps the carry holds, as of the chunk last replayed
        aborting = False
        try:
            if opened is None:
                status, state, last, current = self._start(state, feed.next(0), 0)
            elif isinstance(opened[1], BaseException):
                # Preparing or launching the epoch's first chunk failed: raised where the
                # unfused loop meets that batch, after the epoch before it ended.
                raise opened[1]
            else:
                status, last, current = CONTINUE, 0, opened[1]
            while current is not None:
                status, state, last, current = self._step(state, current, last)
            if status == CONTINUE and replay.pending:
                status, state, last = self._settle(state, last)
        except KeyboardInterrupt:  # a second signal: the data source may be blocked
            aborting = True
            raise
        finally:
            self.ahead = self.stashed = None
            if self.opened is None:  # an epoch opened ahead owns the feed now
                feed.end(wait=not aborting)
        self.latest = None  # the epoch is over: the run holds its State again
        state = state.replace(iteration=last)
        return status, self.mark_held(state) if status == HALT_LOOP else state

    def mark_held(self, state: Any) -> Any:
        """`state` noting how many of its epoch's steps the carry holds (`note_held`)."""
        return note_held(state, self.held, self.handoff.bus)

    def pulled_ahead(self, pulled: int) -> int:
        """Of the `pulled` batches of the epoch, those neither stepped (the carry holds their
        steps) nor kept to be handed out again (`HostFeed.leave` warns of those)."""
        return pulled - self.held - len(getattr(self.feed, "pending", ()))

    def reached(self) -> Any:
        """The State reached within the epoch under way (None: none is), with its last
        fired iteration."""
        if self.latest is None:
            return None
        return self.latest.replace(iteration=self.latest_iteration)

    def opens(self, epoch: int) -> bool:
        """Whether `epoch` was opened with its first chunk launched (its accumulators are
        already fresh)."""
        return self.opened is not None and self.opened[0] == epoch and _launched(self.opened)

    def opened_for(self, epoch: int) -> bool:
        """Whether `open_next` opened `epoch` (launched or not)."""
        return self.opened is not None and self.opened[0] == epoch

    def open_next(self, epoch: int, iterator: Callable[[], Any], bound: int | None) -> None:
        """Opens `epoch` before the epoch now ending is read: its first chunk is prepared
        and launched on fresh accumulators (the ending epoch's are kept for its metrics,
        `Carry.open_epoch`), so the device does not wait for the host in between. Only
        when no handler can act between the two epochs (the run checks); the chunk is
        replayed by `run` for `epoch`, in order. `iterator()` makes the epoch's iterator:
        an error making it, as preparing the chunk, is raised by `run` for `epoch`, where
        the unfused loop meets it (after the ending epoch completes).
        """
        feed = self.feed
        feed.end()  # the ending epoch has prepared its last chunk
        record = self.handoff.bus.has_iteration_handlers
        try:  # the source's iterator for the epoch (a callable source is called here)
            feed.begin(epoch, iterator(), bound, record or self.guard)
            prepared = feed.next(0)
        except Exception as error:  # noqa: BLE001 - raised by `run`, in the unfused order
            self.opened = (epoch, error)
            return
        if prepared is None:
            self.opened = (epoch, None)
            return
        self.carry.open_epoch()
        try:
            self.opened = (epoch, feed.launch(self.carry, prepared))
        except Exception as error:  # noqa: BLE001 - a step that failed on the device
            # Raised by `run` for `epoch`, as a preparing error is: the ending epoch, whose
            # steps all ran, completes first (the unfused loop records it before that step).
            self.opened = (epoch, error)

    def close(self, wait: bool = True) -> None:
        """Ends the feed's epoch, one opened early that will not run or one an abort left
        (the run is leaving); `wait=False` (an abort) does not wait for a pull under way."""
        self.opened = None
        if self.feed is not None:  # None: a whole-run dispatch steps the epochs
            self.feed.end(wait)
            if wait:
                self.feed.leave()

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
                self.feed.put_back(prepared)  # pulled, never stepped: exact consumption
                return status, state, last, None
        return CONTINUE, state, last, self.feed.launch(self.carry, prepared)

    def _step(
        self, state: Any, current: ChunkResult, last: int
    ) -> tuple[str, Any, int, ChunkResult | None]:
        """Replays `current` and launches the next chunk: `(status, state, last, next)`."""
        feed = self.feed
        nxt, failed = None, None
        # Launched, its steps are the carry's: a State leaving from here on says so.
        self.held = current.end
        if feed.ahead and not current.exhausted:
            # Overlap: the host prepares the next chunk while the device runs this one.
            nxt, failed = self._prepare(current.end)
        rollback = speculative = None
        opened_ahead = False
        waits = self.speculate and self._replay.waits_for(current) and not current.done()
        # The feed knows the epoch is over when the chunk came short, or when it was
        # asked for the next one and had none.
        over = current.exhausted or (feed.ahead and nxt is None and failed is None)
        if waits and over and self.ahead is not None:
            # The epoch's last chunk: what to launch ahead of its replay is the next
            # epoch's first chunk, undone as below if the replay halts the run.
            rollback, opened_ahead = self._open_ahead(), True
        elif waits and nxt is not None:
            # The replay is about to wait for this chunk's records: launch the next chunk
            # first, so the device keeps working. Replayed handlers can only halt (or
            # raise), and then the carry goes back to this copy of it. A chunk already done
            # makes nobody wait (the device is idle, and on a CPU the launch would run the
            # chunk on this thread before the replay), so it is replayed first and needs
            # no copy.
            rollback = self.carry.snapshot()
            speculative = feed.launch(self.carry, nxt)
            self.held = speculative.end
            if feed.depth > 1 and not speculative.exhausted:
                # And the chunk after it, so that once the replay's wait ends the host
                # only has to launch it before the device runs out of work.
                self.stashed = (speculative.end, *self._prepare(speculative.end))
        try:
            status, state, last = self._replay.chunk(state, current)
        except BaseException as error:
            self._undo(rollback, opened_ahead, wait=not isinstance(error, KeyboardInterrupt))
            self.held = current.end  # rolled back to its end
            raise
        self.latest, self.latest_iteration = state, last
        if status != CONTINUE or self.signals.requested:
            self.cut_short = status != CONTINUE or not over
            # An epoch halted at its end lets the next epoch open ahead as it did.
            if not (opened_ahead and status == HALT_EPOCH and not self.signals.requested):
                self._undo(rollback, opened_ahead)
            self.held = current.end
            return status, state, last, None
        if failed is not None:
            return self._failed(state, last, failed)
        if speculative is not None:
            return status, state, last, speculative
        if not feed.ahead and not current.exhausted:
            try:
                nxt = feed.next(current.end)
            except Exception as error:  # noqa: BLE001 - raised by `_failed`
                return self._failed(state, last, error)
        return self._start(state, nxt, last)

    def _failed(
        self, state: Any, last: int, error: BaseException
    ) -> tuple[str, Any, int, ChunkResult | None]:
        """Raises `error`, met preparing the chunk after `last` (the source's, or stacking
        its batches), where the unfused loop meets it; unless a chunk replayed without
        reading the guard met a non-finite step before it: that halt comes first, and the
        unfused loop never pulls the failing batch (host read: the guard's flag)."""
        if self._replay.pending:
            status, state, last = self._replay.settle(state, last, self.carry.ending_tail())
            if status != CONTINUE:
                self.cut_short = True
                return status, state, last, None
        raise error

    def _prepare(self, first: int) -> tuple[Any, BaseException | None]:
        """The chunk from iteration `first` (None: the epoch is over), prepared earlier
        (`stashed`) or now, and the error preparing it: a batch pulled ahead that fails
        is raised only where the unfused loop would reach it, after the replays before.
        """
        stashed, self.stashed = self.stashed, None
        if stashed is not None:
            if stashed[0] != first:  # its batches are pulled: dropping them loses data
                raise RuntimeError(f"EpochLoop: chunk {stashed[0]} prepared, {first} asked")
            return stashed[1], stashed[2]
        try:
            return self.feed.next(first), None
        except Exception as error:  # noqa: BLE001 - raised by the caller, after the replay
            return None, error

    def _settle(self, state: Any, last: int) -> tuple[str, Any, int]:
        """The guard's verdict on the epoch's deferred chunks (`EpochReplay.settle`). Where
        the next epoch may open, it opens first, so the device goes on while the host reads
        the ending epoch's flag; a non-finite step rolls that opening back.
        """
        rollback, opened_ahead = None, False
        if self.ahead is not None:
            rollback, opened_ahead = self._open_ahead(), True
        try:
            status, state, last = self._replay.settle(state, last, self.carry.ending_tail())
        except BaseException as error:
            self._undo(rollback, opened_ahead, wait=not isinstance(error, KeyboardInterrupt))
            raise
        if status != CONTINUE:
            self._undo(rollback, opened_ahead)
        return status, state, last

    def _open_ahead(self) -> Any:
        """Opens the next epoch ahead of the last chunk's replay: the carry's copy to roll
        back to, or None when nothing was launched (no batch, or an error to raise later).
        """
        assert self.ahead is not None
        epoch, iterator, bound = self.ahead
        rollback = self.carry.snapshot()
        self.open_next(epoch, iterator, bound)
        return rollback if self.opened is not None and _launched(self.opened) else None

    def _undo(self, rollback: Any, opened_ahead: bool, wait: bool = True) -> None:
        """Undoes what was launched ahead of a replay that halted or raised: the carry
        goes back to `rollback` (None: nothing was launched); a chunk of this epoch gives
        its place back to the feed, an epoch opened ahead is closed (the run is ending;
        `wait=False`, an abort, does not wait for its source's pull under way).
        """
        if rollback is not None:
            self.carry.restore(rollback)
        if opened_ahead:
            self.close(wait)
        elif rollback is not None:
            self.feed.unlaunch()


def note_held(state: Any, held: int, bus: Any) -> Any:
    """`state` noting that the carry holds `held` of its epoch's steps (`HELD_KEY`) where
    that is more than the iterations completed (a fused chunk, or a dispatch of several
    epochs, runs whole), for a resume from it to say what it repeats. The guard's halt
    keeps the last finite step's state, which the completed iterations count already."""
    completed = bus.in_epoch[Event.ITERATION_COMPLETED]
    if held <= completed or NONFINITE_KEY in state.handler_metadata:
        return state
    return state.replace(handler_metadata={**state.handler_metadata, HELD_KEY: held})


def _launched(opened: tuple[int, Any]) -> bool:
    return isinstance(opened[1], ChunkResult)
