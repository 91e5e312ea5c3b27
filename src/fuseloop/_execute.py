"""Executes an epoch's steps, unfused (one dispatch per batch) or fused (one per chunk).

Both paths run the same compiled device loop (`_programs.py`): the unfused one with one live
slot per dispatch. What differs is *when* steps are launched and *when* the host sees their
results:

  unfused: one dispatch per batch; the host reads metrics only when a handler fires, and
           blocks every `max_in_flight` steps so it never runs unboundedly ahead.
  fused:   one transfer + one dispatch per chunk; while chunk n runs, chunk n+1 is pulled,
           stacked and transferred; per-iteration records are read once per chunk, and only
           when an iteration handler needs them.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import numpy as np

from ._events import CONTINUE, HALT_LOOP, Event
from ._fusion import FusionError, resolve_fuse, stack_chunk
from ._checks import Checker
from ._placement import Placement
from ._prefetch import ChunkProducer
from ._programs import MIN_SLOTS, Programs
from ._start import private_copy

__all__ = ["Executor"]

_STARTED, _COMPLETED = Event.ITERATION_STARTED, Event.ITERATION_COMPLETED
_ONE = np.int32(1)  # an unfused dispatch's live slots, passed at run time (see _programs)


def _epoch_length(source: Any, iterations: int | None) -> int | None:
    """Batches per epoch where known (a sized re-iterable source, or `iterations`)."""
    known = [] if iterations is None else [iterations]
    if not source.one_shot:
        try:
            known.append(len(source.data))
        except TypeError:
            pass
    return min(known) if known else None


class Executor:
    """Holds the device-side carry (step state + metric tail) and runs epochs."""

    def __init__(self, loop: Any, *, fuse: Any, jit: bool, mesh: Any, stats: dict[str, Any],
                 max_in_flight: int, reads: Any, prefetch: int = 2):
        self.loop, self.jit, self.stats, self.reads = loop, jit, stats, reads
        self.fuse = resolve_fuse(fuse, jit)
        self.max_in_flight = max_in_flight
        self.prefetch = prefetch
        self.compiled = Programs(loop)
        self.placement = Placement(mesh, stats)
        self.checker = Checker(loop.program, loop._cache)
        self.epoch = 0
        self.state: Any = None
        self.tail: Any = None
        self.pending: list[Any] = []
        self._metrics_cache: dict[str, float] | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self, step_state: Any, first_batch: Any, source: Any, start_epoch: int,
              iterations: int | None = None) -> None:
        self.state = self.placement.put_state(step_state)
        self.pending = [first_batch]
        self.resident = None
        if getattr(source.data, "resident", False):
            from ._resident import ResidentData

            self.pending = []  # the first batch only shaped the initialization
            self.resident = ResidentData(source.data, self, start_epoch)
        if self.fuse == "auto":
            from .diagnostics import choose_chunk_size

            self.fuse = choose_chunk_size(self.loop, step_state, first_batch,
                                          placement=self.placement,
                                          epoch_length=_epoch_length(source, iterations))
        self.stats["chunk_size"] = self.fuse or 1

    def traces(self) -> int:
        return self.compiled.traces

    def adopt(self, step_state: Any) -> None:
        """Takes a step state a handler returned (epoch-level events; unfused iterations).

        It is copied: the next step donates it, and the handler may still hold its arrays.
        """
        if step_state is not None and step_state is not self.state:
            self.state = self.placement.put_state(private_copy(step_state))

    def reset_metrics(self) -> None:
        self.tail = self.placement.put_state(self.compiled.fresh_tail())
        self._metrics_cache = {}

    def final_metrics(self) -> dict[str, float]:
        return self._live_metrics()

    def _live_metrics(self) -> dict[str, float]:
        if self._metrics_cache is None:
            # Host sync: a handler, or the end of the epoch, needs the metrics.
            self._metrics_cache = self.reads.metrics_of(self.reads.get(self.tail["acc"]))
        return self._metrics_cache

    def _pull(self, iterator: Iterator[Any], source: Any, count: int) -> list[Any]:
        batches, self.pending = self.pending[:count], self.pending[count:]
        if len(batches) < count:
            batches += source.pull(iterator, count - len(batches))
        return batches

    def run_epoch(self, state: Any, iterator: Iterator[Any], source: Any, bound: int | None,
                  bus: Any, signals: Any) -> tuple[str, Any]:
        self.epoch = state.epoch
        if self.resident is not None:
            if self.fuse is not None:
                return self.resident.run_epoch(state, bound, bus, signals)
            return self._unfused_epoch(state, *self.resident.unfused_feed(bound), bus, signals)
        if self.fuse is not None:
            return self._fused_epoch(state, iterator, source, bound, bus, signals)
        return self._unfused_epoch(state, *self._host_feed(iterator, source), bound, bus,
                                   signals)

    def _host_feed(self, iterator: Iterator[Any], source: Any) -> tuple[Any, Any]:
        """`(next_batch, dispatch)` for unfused steps on batches pulled from the host."""

        def next_batch(i: int) -> Any:
            batch = self._pull(iterator, source, 1)
            return batch[0] if batch else None

        if not self.jit:
            step = self.compiled.eager_step()

            def dispatch_eagerly(batch: Any, i: int) -> None:
                self.checker.batch(batch, self.epoch, i)
                self.state, self.tail = step(self.state, self.tail, batch)

            return next_batch, dispatch_eagerly
        program = self.compiled.unfused()

        def dispatch(batch: Any, i: int) -> None:
            self.checker.batch(batch, self.epoch, i)
            device_batch = self.placement.put_batch(batch, i)
            self.state, self.tail = program(self.state, self.tail, device_batch, _ONE)

        return next_batch, dispatch

    # ----------------------------------------------------------------- unfused
    def _unfused_epoch(self, state: Any, next_batch: Any, dispatch: Any, bound: int | None,
                       bus: Any, signals: Any) -> tuple[str, Any]:
        """One dispatch per batch: `next_batch(i)` gives it (None at the end),
        `dispatch(batch, i)` steps it."""
        status, i, in_flight, last = CONTINUE, 0, 0, 0
        while bound is None or i < bound:
            batch = next_batch(i)
            if batch is None:
                break
            last = i
            status, state = self._fire_live(bus, _STARTED, state, i)
            if status != CONTINUE:
                break
            dispatch(batch, i)
            self.stats["dispatches"] += 1
            self._metrics_cache = None
            if self.loop.guard_nonfinite and self._nonfinite():
                status, state = HALT_LOOP, self._mark_nonfinite(state, i)
                break
            status, state = self._fire_live(bus, _COMPLETED, state, i)
            bus.advance(1, self._metrics_cache)
            i, in_flight = i + 1, in_flight + 1
            if in_flight >= self.max_in_flight:
                # Flush: wait for the queued steps so the host stays at most
                # max_in_flight steps ahead (no value is read).
                jax.block_until_ready(self.tail)
                in_flight = 0
            if status != CONTINUE or signals.requested:
                break
        return status, state.replace(iteration=last)

    def _fire_live(self, bus: Any, event: Event, state: Any, i: int) -> tuple[str, Any]:
        """Fires an unfused iteration event with the live step state; adopts a step state
        a handler returned."""
        live = self.state
        status, fired = bus.fire_iteration(event, state, i, self._live_metrics, live)
        if fired is not state and fired.step_state is not live:
            self.adopt(fired.step_state)
        return status, fired

    def _nonfinite(self) -> bool:
        # Host sync: terminate_on_nan in an unfused loop checks every step.
        return bool(self.reads.get(self.tail["nonfinite"]))

    def _mark_nonfinite(self, state: Any, iteration: int) -> Any:
        where = {"epoch": state.epoch, "iteration": iteration}
        return state.replace(iteration=iteration,
                             handler_metadata={**state.handler_metadata, "_nonfinite_at": where})

    # ----------------------------------------------------------------- fused
    def _prepare(self, iterator: Iterator[Any], source: Any, first_index: int,
                 bound: int | None) -> tuple[Any, int, int] | None:
        """Pulls, stacks and transfers the next chunk: `(device_chunk, n, requested)`."""
        size = self.fuse
        requested = size if bound is None else min(size, bound - first_index)
        size = max(size, MIN_SLOTS)
        if requested <= 0:
            return None
        batches = self._pull(iterator, source, requested)
        if not batches:
            return None
        self.checker.chunk(batches, self.epoch, first_index)
        try:
            stacked = stack_chunk(batches, size, first_index)
        except FusionError:
            self.checker.explain_chunk(batches, self.epoch, first_index)
            raise
        self.checker.stacked(stacked, len(batches), self.epoch, first_index)
        chunk = self.placement.put_chunk((stacked, np.int32(len(batches))))
        return chunk, len(batches), requested

    def _fused_epoch(self, state: Any, iterator: Iterator[Any], source: Any,
                     bound: int | None, bus: Any, signals: Any) -> tuple[str, Any]:
        record = bus.has_iteration_handlers
        guard = self.loop.guard_nonfinite
        # Pulling ahead is harmless for re-iterable sources; for a one-shot iterator only
        # when no iteration handler can halt mid-chunk (exact consumption wins).
        ahead = source.prefetch_safe or not (record or guard)
        prepare = lambda first: self._prepare(iterator, source, first, bound)  # noqa: E731
        threaded = ahead and self.prefetch > 0 and not source.in_memory
        producer = ChunkProducer(prepare, self.prefetch) if threaded else None
        next_chunk = producer.get if producer else prepare
        status, i, last = CONTINUE, 0, 0
        self._previous: Any = dict  # metrics before the epoch's first iteration: none
        try:
            nxt = next_chunk(0)
            current = self._dispatch(nxt) if nxt is not None else None
            while current is not None:
                records, n_run, n, requested, tail = current
                exhausted = n < requested or (bound is not None and i + n >= bound)
                nxt = None
                if ahead and not exhausted:
                    # Overlap: the device runs this chunk while the host prepares the next.
                    nxt = next_chunk(i + n)
                speculative, rollback = None, None
                if nxt is not None and record and bus.firing_offsets(n):
                    # The handlers are about to wait for this chunk's records: launch the
                    # next chunk first, so the device keeps working meanwhile. Handlers of a
                    # fused loop can only halt (never change the step state), and a halt
                    # rolls back to a device copy of this chunk's results.
                    rollback = private_copy((self.state, self.tail))
                    tail = rollback[1]  # this chunk's own tail is donated to the next one
                    speculative = self._dispatch(nxt)
                status, state, last = self._replay(state, bus, i, n, records, n_run, record,
                                                   guard, tail)
                i += n
                if status != CONTINUE or signals.requested:
                    if rollback is not None:
                        self._restore(rollback)
                    break
                if not ahead and not exhausted:
                    nxt = next_chunk(i)
                current = speculative or (self._dispatch(nxt) if nxt is not None else None)
        finally:
            if producer is not None:
                producer.stop()
        return status, state.replace(iteration=last)

    def _restore(self, snapshot: tuple[Any, Any]) -> None:
        """Rolls the carry back to a snapshot: a speculatively launched chunk is dropped
        (its batches count as pulled ahead, its dispatch does not count)."""
        self.state, self.tail = snapshot
        self.stats["dispatches"] -= 1

    def _dispatch(self, prepared: Any) -> tuple[Any, ...]:
        """Launches a prepared chunk: `(records, n_run, n, requested, tail after it)`."""
        (chunk, n_valid), n, requested = prepared
        program = self.compiled.chunk()
        with self.placement.chunk_transfer():  # the chunk's one explicit transfer
            self.state, self.tail, records, n_run = program(self.state, self.tail, chunk,
                                                            n_valid)
        self.stats["dispatches"] += 1
        self._metrics_cache = None
        return records, n_run, n, requested, self.tail

    def _replay(self, state: Any, bus: Any, first: int, n: int, records: Any, n_run: Any,
                record: bool, guard: bool, tail: Any) -> tuple[str, Any, int]:
        """Fires the chunk's iteration events on the host, in unfused order.

        Returns the status, the State, and the last iteration whose events fired. Only the
        iterations at which some handler fires (judged from the counters) are visited; the
        others advance the counters in bulk. A chunk in which no handler fires is not read
        at all: its records stay on the device in case the next chunk's first
        `iteration_started` needs them.
        """
        firing = bus.firing_offsets(n) if record else []
        if not guard and not firing:
            bus.skip_iterations(n)
            bus.advance(n, None)
            if record:
                self._previous = self._record_at(records, n - 1, on_device=True)
            return CONTINUE, state, first + n - 1
        # Host sync: once per chunk, the records (and the non-finite flag) come back.
        wanted = {"records": records, "n_run": n_run}
        if guard:
            wanted["nonfinite"] = tail["nonfinite"]
        host = self.reads.get(wanted)
        good = int(host["n_run"]) - 1 if guard and bool(host["nonfinite"]) else n
        metrics_at = (lambda j: self._record_at(host["records"], j)) if record else (
            lambda j: dict)
        done = 0  # iterations of this chunk whose events have been accounted for
        for j in (j for j in firing if j < good):
            bus.skip_iterations(j - done)
            before = self._previous if j == 0 else metrics_at(j - 1)
            self._previous = metrics_at(j)
            done = j + 1
            status, state = bus.fire_iteration(_STARTED, state, first + j, before, None)
            if status != CONTINUE:
                return status, state, first + j
            status, state = bus.fire_iteration(_COMPLETED, state, first + j, self._previous,
                                               None)
            if status != CONTINUE:
                return status, state, first + j
        bus.skip_iterations(good - done)
        if good:
            self._previous = metrics_at(good - 1)
        if good < n:  # the non-finite step: its iteration started, then the loop halts
            _, state = bus.fire_iteration(_STARTED, state, first + good, self._previous, None)
            return HALT_LOOP, self._mark_nonfinite(state, first + good), first + good
        bus.advance(n, self._previous() if record else None)
        return CONTINUE, state, first + n - 1

    def _record_at(self, records: Any, j: int, on_device: bool = False) -> Any:
        """Metrics of slot `j` of a chunk's records, built (and, for records still on the
        device, read) only when first asked for."""
        cache: dict[str, Any] = {}

        def metrics() -> dict[str, float]:
            if "value" not in cache:
                # Host sync (records on the device only): an iteration_started handler needs
                # the previous chunk's last iteration's metrics.
                host = self.reads.get(records) if on_device else records
                cache["value"] = self._record_metrics(host, j)
            return cache["value"]

        return metrics

    def _record_metrics(self, records: Any, j: int) -> dict[str, float]:
        acc = {name: {"sum": rec["sum"][j], "count": rec["count"][j]}
               for name, rec in records.items()}
        return self.reads.metrics_of(acc)
