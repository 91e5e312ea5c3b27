"""Feeds: what hands the epoch loop its chunks (docs/design.md §1).

A feed prepares a chunk (`next`) and launches it on the carry (`launch`), which returns a
`ChunkResult`. The host feed pulls, checks, stacks and transfers batches; the resident feed
gathers them on the device. Either runs *chunked* (`fuse=K`) or *live* (`fuse=False`):
chunks of one step whose `iteration_started` the epoch loop fires before the launch, with
the live step state — the unfused loop is that mode, not another loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._fused_short_batch import refuse_short_batch
from .._fusion import chunk_slots, stack_chunk
from .._placement import device_int
from .prefetch import ChunkProducer
from .programs import MIN_SLOTS, kept_order
from .replay import ChunkResult

__all__ = [
    "Prepared",
    "HostFeed",
    "ResidentFeed",
    "epoch_counter",
]


@dataclass(frozen=True)
class Prepared:
    """A chunk ready to launch: its first iteration, live steps, and what the launch needs."""

    first: int
    n: int
    exhausted: bool  # nothing follows it in this epoch
    payload: Any


class HostFeed:
    """Batches pulled from a host source: stacked and transferred per chunk, or one live
    step per batch (`size=None`).
    """

    def __init__(
        self,
        source: Any,
        first_batch: Any,
        first_iterator: Any,
        *,
        size: int | None,
        jit: bool,
        placement: Any,
        checker: Any,
        programs: Any,
        prefetch: int,
        max_in_flight: int,
        halts: bool = False,
    ):
        self.source, self.placement, self.checker = source, placement, checker
        self.halts = halts  # a handler or the guard may halt an epoch before its end
        self.size, self.live = size, size is None
        self.prefetch, self.max_in_flight = prefetch, max_in_flight
        self.pending = [first_batch]  # pulled to initialize: it is the first step's batch
        self.pending_from = first_iterator  # ... of the epoch that pulls from this iterator
        if self.live:
            self.program = programs.unfused() if jit else programs.eager_step()
            self.jit = jit
            self.one = placement.count(1)  # every unfused dispatch has one live slot
        else:
            self.program = programs.chunk()
        self.copies = programs.copies and not self.live
        self.ahead, self.depth = False, 0
        self.failed: Exception | None = None  # the source's error, raised by the next pull
        self._producer: ChunkProducer | None = None
        self.abandoned = False  # an abort left the producer thread: it stops pulling

    # ----------------------------------------------------------------- epoch
    def begin(
        self, epoch: int, iterator: Iterator[Any], bound: int | None, replay_reads: bool
    ) -> None:
        """Starts an epoch. `replay_reads`: some handler or the guard will read a chunk's
        results on the host (a halt may then stop the epoch mid-way).
        """
        length = self.source.epoch_length
        if length is not None:  # the epoch's last step is known to be its last
            bound = length if bound is None else min(bound, length)
            data, at_end = self.source.data, bound == length
            refuse_short_batch(
                data, self.placement, self.checker, at_end, epoch, self.live, self.halts
            )
        if iterator is not getattr(self, "iterator", None):
            self.failed = None  # an error pulled ahead in a pass an earlier epoch left
        self.epoch, self.iterator, self.bound = epoch, iterator, bound
        if iterator is not self.pending_from:
            # The run's first epoch ended before its first step (a halt at epoch_started):
            # its batch belongs to that epoch's pass; a one-shot iterator keeps it.
            self.pending = []
        # Pulling ahead is harmless for re-iterable sources; for a one-shot iterator only
        # when nothing can halt mid-chunk (exact consumption wins).
        self.ahead = not self.live and (self.source.prefetch_safe or not replay_reads)
        threaded = self.ahead and self.prefetch > 0 and not self.source.in_memory
        self._producer = ChunkProducer(self._prepare, self.prefetch) if threaded else None
        # Chunks the epoch loop may prepare ahead of the one the device runs: on this
        # thread, up to `prefetch` (at least the next one); with a producer thread, which
        # already holds `prefetch` chunks (and counts the last one handed out), one more
        # taken from it would pull past that bound.
        self.depth = 0 if not self.ahead else 1 if threaded else max(1, self.prefetch)

    def end(self, wait: bool = True) -> None:
        """Ends the epoch's pulling ahead; `wait=False` (an abort) leaves a pull under way
        to finish on its own."""
        if self._producer is not None:
            self.abandoned = not wait
            self._producer.stop(wait)
            self._producer = None

    def next(self, first: int) -> Prepared | None:
        """The next chunk, starting at iteration `first`, or None at the epoch's end."""
        if self._producer is not None:
            return self._producer.get()
        return self._prepare(first)

    def unlaunch(self) -> None:
        """The last launch was dropped; its batches count as pulled ahead."""

    def drop_first_batch(self) -> None:
        """The first pass is opened again (`Run._iterator`): its batch is not the new's."""
        self.pending, self.pending_from = [], None

    def put_back(self, prepared: Prepared) -> None:
        """A live step its `iteration_started` halted never ran: its batch is handed out
        first again, so a one-shot iterator's next epoch starts with it (a re-iterable's
        next pass opens a new iterator and drops it, `begin`)."""
        self.pending.insert(0, prepared.payload)
        self.pending_from = self.iterator

    def leave(self) -> None:
        """The run is over: a one-shot iterator's batches pulled and never stepped are lost
        to the caller (`Source.warn_unstepped`)."""
        self.source.warn_unstepped(len(self.pending))

    # ----------------------------------------------------------------- preparing
    def _pull(self, count: int) -> list[Any]:
        """Up to `count` batches. Where the source raises part-way, the batches pulled
        before the error make a short chunk that is stepped, and the error is raised by
        the next pull: where the unfused loop meets it, after stepping those batches."""
        if self.failed is not None:
            error, self.failed = self.failed, None
            raise error
        batches, self.pending = self.pending[:count], self.pending[count:]
        if len(batches) < count:
            # An abort stops a producer thread's pull between batches (`abandoned`).
            more, error = self.source.pull_until_error(
                self.iterator, count - len(batches), stop=lambda: self.abandoned
            )
            batches += more
            if error is not None and not batches:
                raise error
            self.failed = error
        return batches

    def _prepare(self, first: int) -> Prepared | None:
        requested = 1 if self.size is None else self.size
        if self.bound is not None:
            requested = min(requested, self.bound - first)
        if requested <= 0:
            return None
        batches = self._pull(requested)
        if not batches or self.abandoned:  # an abort: nothing more is stacked or moved
            return None
        n = len(batches)
        ran_out = n < requested and self.failed is None  # not a chunk cut short by an error
        exhausted = ran_out or (self.bound is not None and first + n >= self.bound)
        if self.live:  # checked before its iteration_started, as a chunk's when stacked
            self.checker.batch(batches[0], self.epoch, first)
            return Prepared(first, 1, exhausted, batches[0])
        try:
            return Prepared(first, n, exhausted, self._stack(batches, first))
        except Exception as error:  # noqa: BLE001 - raised here, or by the next pull
            good = self._before_refused(batches, first, error)
            return Prepared(first, good, False, self._stack(batches[:good], first))

    def _before_refused(self, batches: list[Any], first: int, error: Exception) -> int:
        """How many of a chunk's batches come before the one fuseloop's checks refuse (the
        unfused loop steps them, then raises there): those are stepped as a short chunk and
        the refused batch's error (which names its leaf, where stacking names a position) is
        raised by the next pull; the batches pulled after it are held back, unstepped.
        Raises that error now where the first batch is refused, and `error` where none alone
        is (the chunk as a whole failed)."""
        good, refused = self.checker.first_refused(batches, self.epoch, first)
        if refused is None:
            raise error
        if good == 0:
            raise refused
        self.failed = refused  # that batch's own error: the chunk's may name a later one
        self.pending, self.pending_from = batches[good + 1 :] + self.pending, self.iterator
        return good

    def _stack(self, batches: list[Any], first: int) -> Any:
        """Checks and stacks a chunk into `max(K, MIN_SLOTS)` slots (a short one into its
        own size where the device loop steps every slot: `chunk_slots`); one transfer."""
        self.checker.chunk(batches, self.epoch, first)
        slots = chunk_slots(self.size or 1, len(batches))
        stacked = stack_chunk(batches, max(slots, MIN_SLOTS), first)
        self.checker.stacked(stacked, len(batches), self.epoch, first)
        return self.placement.put_chunk(stacked, len(batches))

    # ----------------------------------------------------------------- launching
    def launch(self, carry: Any, prepared: Prepared) -> ChunkResult:
        if self.live:
            return self._launch_step(carry, prepared)
        try:
            with self.placement.chunk_transfer():  # the chunk's one explicit transfer
                records, n_run = carry.advance(self.program, *prepared.payload, copies=self.copies)
        except Exception as error:
            name_steps(error, self.epoch, prepared)
            raise
        return ChunkResult(
            prepared.first,
            prepared.n,
            records,
            n_run,
            prepared.exhausted,
            carry.tail.get("nonfinite"),
        )

    def _launch_step(self, carry: Any, prepared: Prepared) -> ChunkResult:
        batch, i = prepared.payload, prepared.first
        try:
            if self.jit:
                with self.placement.chunk_transfer():  # the step's batch: its one transfer
                    carry.advance(self.program, self.placement.put_batch(batch, i), self.one)
            else:
                carry.advance(self.program, batch)
        except Exception as error:
            name_steps(error, self.epoch, prepared)
            raise
        carry.throttle(self.max_in_flight)
        return ChunkResult(i, 1, None, None, prepared.exhausted)


class ResidentFeed:
    """A device-resident `fl.data.arrays(..., device=True)` dataset: chunks are gathered on
    the device from the epoch's order, which is computed there too; nothing moves from the
    host per epoch. With `drop_remainder=False` the short last batch is its own launch.
    """

    def __init__(
        self,
        source: Any,
        data: Any,
        *,
        size: int | None,
        placement: Any,
        programs: Any,
        start_epoch: int,
        max_in_flight: int,
    ):
        self.source, self.programs = source, programs
        self.size, self.live = (1 if size is None else size), size is None
        self.max_in_flight = max_in_flight  # unfused steps queued before the host waits
        self.ahead = not self.live
        self.depth = 2 if self.ahead else 0  # preparing a chunk only names its program
        # Over a mesh the dataset is split along its example axis and each gathered chunk
        # is sharded along its batch axis, as a host-fed chunk would be; the gather inside
        # the program fetches rows held by other devices (XLA adds the collectives).
        self.sharding = placement.chunk_sharding(source.batch_size)
        self.whole = source.n // source.batch_size
        self.short = source.short_batch or None
        self.short_sharding = (
            placement.chunk_sharding(self.short, short=True) if self.short is not None else None
        )
        self.data = data
        # The epoch counter lives on the device (a device int32 scalar holding
        # `start_epoch`), so advancing it moves nothing.
        self.epoch_counter = epoch_counter(start_epoch)
        self.counted_epoch = start_epoch  # the epoch the counter holds
        self.start_epoch = start_epoch
        self.next_order = programs.epoch_order(source)

    def begin(self, epoch: int, iterator: Any, bound: int | None, replay_reads: bool) -> None:
        if self.counted_epoch != epoch:
            # An epoch was skipped (halted at epoch_started): its order is not this one's.
            self.epoch_counter = epoch_counter(epoch)
        self.order, self.epoch_counter, self.cursor = self._order(epoch)
        self.counted_epoch = epoch + 1
        self.limit = (
            self.source.num_batches if bound is None else min(bound, self.source.num_batches)
        )
        self.full_limit = min(self.limit, self.whole)
        self._before = self.cursor

    def _order(self, epoch: int) -> tuple[Any, Any, Any]:
        """`(order, counter of the next epoch, cursor 0)` for `epoch`, on the device. A
        run's first epoch takes its order from beside the source (`kept_order`), so a
        later run from the same epoch launches its first chunk without this dispatch
        ahead of it.
        """
        if epoch != self.start_epoch:
            return self.next_order(self.epoch_counter)
        order = kept_order(self.source, epoch, lambda: self.next_order(self.epoch_counter)[0])
        return order, epoch_counter(epoch + 1), device_int(0)

    def end(self, wait: bool = True) -> None:
        pass

    def put_back(self, prepared: Prepared) -> None:
        """Nothing to give back: preparing a chunk takes nothing from the epoch's order."""

    def leave(self) -> None:
        pass

    def next(self, first: int) -> Prepared | None:
        if first >= self.limit:
            return None
        if first >= self.full_limit:  # the short last batch: one step of its own shape
            program = self.programs.resident(MIN_SLOTS, 1, self.short, self.short_sharding)
            return Prepared(first, 1, True, (program, self.limit))
        n = min(self.size, self.full_limit - first)
        live = chunk_slots(self.size, n)
        program = self.programs.resident(max(live, MIN_SLOTS), live, None, self.sharding)
        return Prepared(first, n, first + n >= self.limit, (program, self.full_limit))

    def launch(self, carry: Any, prepared: Prepared) -> ChunkResult:
        program, limit = prepared.payload
        self._before = self.cursor
        try:
            records, n_run, self.cursor = carry.advance(
                program,
                self.data,
                self.order,
                self.cursor,
                device_int(limit),
                copies=self.programs.copies,
            )
        except Exception as error:
            name_steps(error, self.counted_epoch - 1, prepared)
            raise
        if self.live:
            carry.throttle(self.max_in_flight)
            return ChunkResult(prepared.first, 1, None, None, prepared.exhausted)
        return ChunkResult(
            prepared.first,
            prepared.n,
            records,
            n_run,
            prepared.exhausted,
            carry.tail.get("nonfinite"),
        )

    def unlaunch(self) -> None:
        """The last launch was dropped: its place in the epoch is given back."""
        self.cursor = self._before

    def drop_first_batch(self) -> None:  # nothing is pulled to initialize
        pass


def name_steps(error: Exception, epoch: int, prepared: Prepared) -> None:
    """Notes on `error`, raised where the device ran `prepared`'s steps (an error
    `jax.debug_nans` raises, a failed dispatch), the epoch and iterations they were."""
    last = prepared.first + prepared.n - 1
    steps = f"iterations {prepared.first}-{last}" if prepared.n > 1 else f"iteration {last}"
    error.add_note(f"fuseloop: raised by the steps of epoch {epoch}, {steps}")
    name_nan_op(error)


@contextlib.contextmanager
def noting_dispatch(steps: int, epoch: int, iteration: int) -> Iterator[None]:
    """Notes an error raised inside with the multi-epoch dispatch's steps (`name_steps`'s
    note for a dispatch of `steps` steps from `epoch`, `iteration`)."""
    try:
        yield
    except Exception as error:
        error.add_note(
            f"fuseloop: raised by the {steps} steps of the dispatch from epoch {epoch}, "
            f"iteration {iteration}"
        )
        name_nan_op(error)
        raise


def name_nan_op(error: Exception) -> None:
    """Where `jax_debug_nans` raised as the NaN left fuseloop's device loop ("in while"), a
    note on how to have JAX name the operation (a run with jit=False is named already)."""
    if isinstance(error, FloatingPointError) and "while" in str(error):
        error.add_note(
            "fuseloop: the NaN was seen leaving fuseloop's device loop; rerun with "
            "run(..., fuse=False, jit=False) for JAX to name the operation that made it"
        )


def epoch_counter(epoch: int) -> Any:
    """A device int32 scalar holding `epoch`: where a resident run's device epoch counter
    starts. No program donates it, so one array serves every run that starts at `epoch`.
    """
    return device_int(epoch)
