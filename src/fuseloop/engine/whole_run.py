"""Whole-run fusion: many epochs per dispatch on device-resident data (docs/design.md §9).

    plan ──► dispatch (whole_program: epochs on the device) ──► one host read ──► replay

The run's epoch loop becomes a loop over dispatches. A dispatch starts where the host is
(an epoch just started, or mid-epoch after a `fuse=K` chunk) and runs up to the next
*split point*: the end of an epoch at which a handler that may halt or change the State
fires (known from the counters ahead of time; a callable filter fires everywhere), or the
run's end, or K steps. Handlers that only observe (`Loop.observe`, the log, CSV,
TensorBoard, the progress bar) never split: after the dispatch their events are replayed
in the unfused order, each epoch with its own metrics and history entry, and with
`state.step_state` None for epochs that ended inside the dispatch.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .._events import CONTINUE, HALT_EPOCH, HALT_LOOP, ITERATION_EVENTS, Event
from .._fusion import FusionError
from .._placement import device_int, device_key
from .._state import AHEAD_KEY, NONFINITE_KEY, with_epoch_recorded
from .device_checkpoint import BestSaves
from .device_monitors import DeviceWork, monitor_start, plan_device_work, rate_table
from .device_replay import hand_best, replayed_handlers
from .device_validation import validation_inputs
from .epoch import note_held
from .feeds import noting_dispatch
from .packing import segment_of, unpack_on_host
from .programs import kept_order
from .replay import ChunkResult, EpochReplay, show_nonfinite_halt
from .resume import opening
from .signals import wait_interruptibly
from .whole_program import (
    compiled_segments,
    host_outputs,
    piece_steps,
    segments_for,
    whole_run_key,
    whole_run_program,
)

__all__ = ["WholeRun", "whole_run_refusal"]


def whole_run_refusal(source: Any, iterations: int | None) -> str | None:
    """Why a resident source cannot run many epochs per dispatch (None: it can)."""
    limit = source.num_batches if iterations is None else min(iterations, source.num_batches)
    if limit > source.n // source.batch_size:
        return (
            "the epoch ends with a short batch (drop_remainder=False), whose shape differs; "
            "dispatches end at every epoch (pass drop_remainder=True to cross epochs)"
        )
    return None


class WholeRun:
    """The epochs of one run over a resident source, many per dispatch.

    `run` is the `engine.run.Run` (its bus, carry, handoff, reads, programs, stats);
    `size` is the dispatch's step bound (None: "run", as many epochs as allowed).
    """

    def __init__(self, run: Any, size: int | None, warn_nonfinite: Any):
        source = run.source.data
        self.run, self.size, self.warn_nonfinite = run, size, warn_nonfinite
        self.source = source
        bound = run.iterations
        self.limit = source.num_batches if bound is None else min(bound, source.num_batches)
        self.order_fn = run.programs.epoch_order(source)
        self.order_key = device_key(source.order_spec.key())  # an input: no compile per seed
        self.counter = run.device_epoch
        self.order: Any = None
        self.sharding = run.placement.chunk_sharding(source.batch_size)
        self.guard = run.loop.guard_nonfinite
        self.splits: dict[int, str] = {}
        run.stats["dispatch_splits"] = self.splits
        # validate and early_stop run on the device where they can (device_monitors.py)
        self.work = plan_device_work(run.bus, run.loop.metrics, run.carry.step_state)
        if run.placement.mesh is not None:
            # Over a mesh the host validation runs unsharded; the device twin would not be
            # the same program, so validation and monitors stay on the host (they split).
            self.work = DeviceWork(None)
        self.on_device = set(self.work.registrations)
        self.validation = validation_inputs(self.work, run.programs, run.placement, run)
        # While a dispatch is replayed: the (epoch, iteration) its carry reached, which an
        # error in the replay leaves the State's step state at (engine/run.py `_reached`).
        self.carry_ahead: tuple[int, int] | None = None

    def marked_ahead(self, state: Any) -> Any:
        """`state` (where an error left the run) marked with where the carry had reached,
        where a dispatch's carry ran past it (a resume from it warns: engine/start.py)."""
        ahead = self.carry_ahead
        if ahead is None or ahead <= (state.epoch, state.iteration):
            return state
        return state.replace(handler_metadata={**state.handler_metadata, AHEAD_KEY: ahead})

    # ----------------------------------------------------------------- planning
    def _split_reason(self, epoch: int, current: int) -> str | None:
        """Why a dispatch must end at the end of `epoch` (planned at `current`, whose
        `epoch_started` has fired), or None.
        """
        bus = self.run.bus
        for event in ITERATION_EVENTS:
            for r in bus.by_event.get(event, ()):
                if not r.observes:
                    return f"{r.label} on {event.value} may halt: dispatches end every epoch"
        count = bus.total[Event.EPOCH_COMPLETED] + (epoch - current) + 1
        for r in bus.by_event.get(Event.EPOCH_COMPLETED, ()):
            if r in self.on_device:
                continue
            if not r.observes and (r.filter.needs_state or r.filter.by_count(count)):
                return f"{r.label} on epoch_completed sees the live State"
        count = bus.total[Event.EPOCH_STARTED] + (epoch + 1 - current)
        for r in bus.by_event.get(Event.EPOCH_STARTED, ()):
            if not r.observes and (r.filter.needs_state or r.filter.by_count(count)):
                return f"{r.label} on epoch_started of epoch {epoch + 1} sees the live State"
        return None

    def _steps(self, epoch: int, cursor: int) -> int:
        """Steps of the next dispatch, from iteration `cursor` of `epoch`."""
        last = epoch
        while last < self.run.epochs - 1:
            reason = self._split_reason(last, epoch)
            if reason is not None:
                self.splits[last] = reason
                break
            last += 1
        steps = (last - epoch + 1) * self.limit - cursor
        return steps if self.size is None else min(steps, self.size)

    # ----------------------------------------------------------------- epochs
    def epochs(self, state: Any, signals: Any) -> tuple[Any, bool]:
        """Runs the epochs: `(state, halted)`."""
        run = self.run
        epoch, cursor = run.start_epoch, 0
        while epoch < run.epochs:
            if cursor == 0:
                self.spent = 0.0  # the epoch's share of wall time so far
                status, state = self._begin(state, epoch, live=True)
                if status != CONTINUE:  # epoch_started halted: the epoch does not step
                    state, status = self._finish(state, epoch, status, {}, False, True)
                    if status == HALT_LOOP or signals.requested:
                        return state, True
                    epoch += 1
                    continue
            state, epoch, cursor, halted = self._dispatch(state, epoch, cursor, signals)
            run.state = state
            # A signal during the dispatch's last epoch_completed handlers halts here, before
            # the next epoch starts, as the per-epoch run does (engine/run.py `_epochs`).
            if halted or signals.requested:
                return state, True
        return state, False

    def _begin(self, state: Any, epoch: int, live: bool) -> tuple[str, Any]:
        run = self.run
        run.bus.new_epoch()
        state = opening(state, epoch)
        if live:  # the host starts the epoch: fresh accumulators, the epoch's order
            run.carry.reset_metrics()
            self.order, self.counter = self._epoch_order(epoch)
            run.state = state
            status, state = run.handoff.fire(Event.EPOCH_STARTED, state)
        else:  # started inside the dispatch: only observers are attached here
            status, state = run.bus.fire(Event.EPOCH_STARTED, state.replace(step_state=None))
        self.replay = EpochReplay(run.handoff, run.carry, run.reads, self.guard)
        run.state = state
        return status, state

    def _epoch_order(self, epoch: int) -> tuple[Any, Any]:
        """`(the epoch's order on the device, the device epoch counter after it)`.

        The device counter equals the host's epoch at an epoch's start (each dispatch
        computes the orders of the epochs it enters), so the order is kept beside the
        source for later runs, which then launch no program for it.
        """
        order = kept_order(self.source, epoch, lambda: self.order_fn(device_int(epoch))[0])
        return order, np.int32(epoch + 1)

    def _launch(self, state: Any, epoch: int, cursor: int) -> tuple[list[tuple[int, int]], Any]:
        run = self.run
        steps = self._steps(epoch, cursor)
        segments = segments_for(cursor, steps, self.limit)
        slots = self._slots(segments)
        # A rate per reduction the slots allow: the table's shape is the program's, so a
        # dispatch with fewer epochs reuses it.
        self.rates = rate_table(self.work, run.carry.step_state, slots, run.reads)
        self.reductions = 0  # the device's rate reductions replayed so far
        program = whole_run_program(
            run.programs,
            self.source,
            slots,
            self._piece(),
            self.sharding,
            self.work,
            self.replay.record,  # the records only where an iteration handler replays them
        )
        with noting_dispatch(steps, epoch, cursor):
            extra, host = self._advance(program, cursor, steps, monitor_start(self.work, state))
        saver, carry = self.work.saver, self.run.carry.step_state
        self.saves = (
            None
            if saver is None
            else BestSaves(saver.handler, extra["kept_ring"], int(host["kept_n"]), carry)
        )
        return segments, host

    def _advance(self, program: Any, cursor: int, steps: int, monitor: Any) -> tuple[Any, Any]:
        """Runs the dispatch's `program` from the carry and reads its results:
        `(the program's extra, the host's copy of host_outputs)`.
        """
        run = self.run
        with run.placement.chunk_transfer():  # the dispatch's scalars: its one transfer
            out, self.order, self.counter, _ = run.carry.advance(
                program,
                run.dataset,
                self.order,
                self.counter,
                np.int32(cursor),
                np.int32(steps),
                monitor,
                {
                    "validation": self.validation,
                    "rates": self.rates,
                    "order_key": self.order_key,
                    "limit": np.int32(self.limit),
                },
            )
        extra = out["extra"]
        self.best_state = extra.get("best_state")
        # Host read: once per dispatch, every epoch's final accumulators, the steps run,
        # the guard's flags, the device's validation, monitor and checkpoint verdicts, and
        # the records when an iteration handler is attached: packed, a buffer per dtype.
        # The wait for it lets a second Ctrl-C abort meanwhile (signals.py).
        wait_interruptibly(out["packed"])
        host = unpack_on_host(run.reads.get(out["packed"]), host_outputs(out, extra))
        return extra, host

    def _slots(self, segments: list[tuple[int, int]]) -> int:
        """The program's segment slots: with `fuse=K` the most K steps can span from any
        place in an epoch, so a short last dispatch (or a run with other epochs) reuses the
        program; with "run" the dispatch's own count rounded up to a power of two, so the
        dispatches of a run split by its handlers (and runs of other lengths) share a few
        programs instead of compiling one per count; a program already compiled with more
        slots is taken rather than compiling a smaller one. Unused slots run nothing.
        """
        if self.size is None:
            needed = 1 << (len(segments) - 1).bit_length()
            compiled = compiled_segments(self.run.programs.cache.whole_run, needed, self._key)
            return needed if compiled is None else compiled
        return -(-self.size // self.limit) + 1

    def _key(self, segments: int) -> Any:
        """The cache key of this run's program of `segments` slots."""
        piece, record = self._piece(), self.replay.record
        return whole_run_key(self.source, segments, piece, self.sharding, self.work, record)

    def _piece(self) -> int:
        """The step slots of the program's epoch pieces (`piece_steps`)."""
        return piece_steps(self.source, self.limit, self.replay.record)

    def _dispatch(
        self, state: Any, epoch: int, cursor: int, signals: Any
    ) -> tuple[Any, int, int, bool]:
        """One dispatch and its replay: `(state, epoch, cursor, halted)`."""
        began = time.perf_counter()
        segments, host = self._launch(state, epoch, cursor)
        wall = time.perf_counter() - began  # the dispatch, shared by its epochs' steps
        steps = sum(n for _, n in segments)
        executed = int(np.count_nonzero(host["n_run"]))
        if executed == 0:  # the next dispatch would start where this one did, forever
            raise FusionError(
                f"fuseloop: the dispatch from epoch {epoch}, iteration {cursor} ran no step "
                f"(a bug in fuseloop; run with fuse=K at most the epoch's length meanwhile)"
            )
        self.host, self.first_epoch = host, epoch
        self.carry_ahead = _carry_reached(segments[:executed], epoch, self.limit)
        for s, (first, n) in enumerate(segments[:executed]):
            last_one = s == executed - 1
            began = time.perf_counter()
            if s > 0:
                self.spent = 0.0
                _, state = self._begin(state, epoch, live=False)
            result = ChunkResult(
                first,
                n,
                segment_of(host.get("records", ()), s),
                host["n_run"][s],
                first + n == self.limit,
                host["nonfinite"][s],
            )
            status, state, fired = self.replay.chunk(state, result)
            state = state.replace(iteration=fired)
            self.run.state = state
            ended = first + n == self.limit
            if last_one and signals.requested and not ended:
                status = HALT_LOOP  # a signal mid-epoch; an epoch it ran to its end completes
            self.spent += wall * n / steps + time.perf_counter() - began
            if status != CONTINUE or ended:
                final = self.run.reads.metrics_of(segment_of(host["final"], s))
                state, status = self._finish(state, epoch, status, final, True, last_one, s)
                if status == HALT_LOOP:
                    state = note_held(state, first + n, self.run.bus)  # the segment ran whole
                    if self.on_device:  # a halt mid-epoch (the guard): the run's end restores
                        self._hand_best(state, epoch)
                    self.carry_ahead = None
                    return state, epoch, 0, True
                epoch, cursor = epoch + 1, 0
            else:
                cursor = first + n
        if self.on_device:  # a later dispatch's end may restore this one's best epoch
            self._hand_best(state, epoch)
        self.carry_ahead = None  # the replay caught up with the carry
        return state, epoch, cursor, False

    def _finish(
        self,
        state: Any,
        epoch: int,
        status: str,
        final: dict[str, float],
        stepped: bool,
        live: bool,
        segment: int | None = None,
    ) -> tuple[Any, str]:
        """The epoch's end, as the per-epoch run ends it (engine/run.py `_epoch`)."""
        run = self.run
        if status == HALT_LOOP and state.handler_metadata.get(NONFINITE_KEY) is not None:
            self.warn_nonfinite(state)
        replay = self.replay
        metrics = dict(state.metrics)
        wrote_last = stepped and replay.steps > 0 and replay.merged_through == replay.steps - 1
        if not wrote_last:  # last writer wins (docs/design.md §2)
            metrics.update(final)
        seconds = self.spent  # the epoch's wall time: its share of dispatches, its replay
        run.epoch_ended(epoch, seconds)
        state = state.replace(metrics=metrics, times={**state.times, epoch: seconds})
        state, status = self._members_end(state, epoch, status, segment)
        if status == HALT_LOOP:  # halted mid-epoch: not in history
            show_nonfinite_halt(run.bus, state)
            return state, status
        state = with_epoch_recorded(state, epoch)
        run.state = state
        event = Event.EPOCH_HALTED if status == HALT_EPOCH else Event.EPOCH_COMPLETED
        substitute = None
        if segment is not None and self.on_device:
            substitute = self._substitutes(state, epoch, segment, live)
        if live:
            status, state = run.handoff.fire(event, state, True, substitute)
        else:
            replayed = state.replace(step_state=None)
            status, state = run.bus.fire(event, replayed, True, substitute)
        run.state = state
        return state, self._members_after(state, status)

    def _substitutes(self, state: Any, epoch: int, segment: int, live: bool) -> Any:
        """The device-run handlers' replays for the end of `epoch` (dispatch segment
        `segment`; `live`: the dispatch's last epoch, fired with the live State).
        """
        rate = self.rates[0][self.reductions]
        substitute = replayed_handlers(self.work, self.host, segment, live, rate, self.saves)
        self.reductions += int(self.host["reduced"][segment])
        if live:
            self._hand_best(state, epoch)
        return substitute

    def _members_end(
        self, state: Any, epoch: int, status: str, segment: int | None
    ) -> tuple[Any, str]:
        """A population's epoch end before history (population_whole_run.py); solo: as is."""
        return state, status

    def _members_after(self, state: Any, status: str) -> str:
        """A population's members halted by the epoch's handlers; solo: the status."""
        return status

    def _hand_best(self, state: Any, epoch: int) -> None:
        """Before the dispatch's last epoch fires live: `early_stop(restore_best=True)`
        gets the best step state the device kept, if its best epoch ran in this dispatch.
        """
        stopper = self.work.stopper
        if stopper is None or self.best_state is None:
            return
        record = stopper.handler.monitor.record(state)
        best_s = int(self.host["best_s"])
        if best_s >= 0 and self.first_epoch + best_s == record["best_epoch"]:
            hand_best(self.work, self.best_state, record["best_epoch"], record["best"])


def _carry_reached(segments: list[tuple[int, int]], epoch: int, limit: int) -> tuple[int, int]:
    """The (epoch, iteration) of the last step a dispatch's executed `segments` ran, its
    first segment in `epoch` (a segment ending at `limit` ends its epoch)."""
    reached = (epoch, 0)
    for first, n in segments:
        reached = (epoch, first + n - 1)
        epoch += first + n == limit
    return reached
