"""One call of `Loop.run`: the run's parts, its epochs, and what it returns or raises.

The run builds the parts once (source, checker, carry, feed, bus), then loops over epochs:
`epoch_started`, the epoch loop (`epoch.py`), the epoch's metrics (one host read), history,
`epoch_completed`. A halt ends it; an exception leaving it carries the State reached so far
as `err.fuseloop_state` (docs/design.md §2).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from .._checks import Checker
from .._data import as_source
from .._events import CONTINUE, HALT_EPOCH, HALT_LOOP, Event, reopens_first_pass
from .._fusion import resolve_fuse
from .._label_checks import labels_of
from .._model_warnings import warn_about_model
from .._placement import Placement
from .._state import NONFINITE_KEY, State, attach_to_error, new_stats, with_epoch_recorded
from .._warn import warn
from .bus import EventBus
from .carry import Carry
from .dispatch_plan import iteration_bound, plan_dispatches
from .epoch import EpochLoop
from .feeds import HostFeed, ResidentFeed, epoch_counter
from .handoff import Handoff
from .host import HostReads
from .options import refuse_step_state_readers
from .population import first_member, resolve_population
from .population_run import PopulationHost
from .programs import Programs
from .replay import show_nonfinite_halt, warn_nonfinite
from .resident_start import first_resident_batch, place_dataset
from .resume import opening, resumed_metadata, warn_on_resume
from .signals import SignalGuard
from .start import agree_across_processes, agree_on_mesh, initial_step_state
from .weak_leaves import strengthen_weak_leaves
from .whole_run import WholeRun

__all__ = ["Run"]

_RAN_OUT = "ran_out"  # an epoch found no data left: the run ends, completed
_EPOCH_EVENTS = (Event.EPOCH_STARTED, Event.EPOCH_COMPLETED, Event.EPOCH_HALTED)


class Run:
    """One call of `Loop.run` (its plain arguments already checked by `check_run_options`).

    `observer` is told about events and steps without changing the run (the progress bar;
    see `bus.EventBus`), or None.
    """

    def __init__(
        self,
        loop: Any,
        data: Any,
        init_state: Any,
        *,
        epochs: int,
        iterations: int | None,
        fuse: Any,
        jit: bool,
        observer: Any,
        mesh: Any,
        max_in_flight: int,
        prefetch: int,
        population: Any = None,
    ):
        self.population = resolve_population(
            population, loop.program, init_state, fuse=fuse, mesh=mesh
        )
        self.loop, self.epochs, self.iterations = loop, int(epochs), iterations
        self.jit, self.max_in_flight, self.prefetch = jit, max_in_flight, prefetch
        self.init_state = init_state
        self.stats = new_stats()
        self.source = as_source(data, bounded=iterations is not None)
        self.fuse = resolve_fuse(fuse, jit)
        refuse_step_state_readers(loop.registrations, self.fuse)
        self.resident = bool(getattr(self.source.data, "resident", False))
        fixed = loop.program.kind in ("trainer", "evaluator")
        self.bus = EventBus(loop.registrations, observer, fixed)
        self.guard = loop.guard_nonfinite and self.population is None  # population: per member
        # Chunks launched ahead of replays that may halt copy their carry (Programs).
        copies = self.fuse is not None and self.bus.has_iteration_handlers and not self.guard
        self.programs = Programs(loop, self.population, copies=copies)
        members = self.population.size if self.population is not None else 0
        self.reads = HostReads(self.stats, loop.metrics, members)
        self.placement = Placement(mesh, self.stats)
        self.checker = Checker(loop.program, self.programs.cache.verdicts, self.jit)
        self.carry = Carry(self.placement, self.programs, self.reads, self.stats)
        self.handoff = Handoff(self.bus, self.carry)
        host = None if self.population is None else (self.population, self.carry, self.reads)
        self.members = None if host is None else PopulationHost(*host, loop.guard_nonfinite)
        self.epoch_loop: EpochLoop | None = None
        self.whole: WholeRun | None = None  # many epochs per dispatch (whole_run.py)
        self.compiles_before = 0  # the trace count when the epochs' programs start (`_start`)
        bound = iteration_bound(self.source, iterations)
        self.state = State(max_epoch=self.epochs, max_iteration=bound, stats=self.stats)

    # ----------------------------------------------------------------- the run
    def run(self) -> State:
        aborted = False
        try:
            feed = self._start()
            with SignalGuard(self.stats) as signals:  # it names a signal in the stats
                self.epoch_loop = EpochLoop(
                    feed, self.carry, self.handoff, self.reads, self.guard, signals
                )
                state = self._epochs(signals)
        except BaseException as caught:
            # A second signal's KeyboardInterrupt leaves at once, even from a blocked source.
            aborted = isinstance(caught, KeyboardInterrupt)
            error = caught if self.stats["dispatches"] else self.checker.explain(caught)
            reached = self._reached()
            attach_to_error(error, reached)
            for failure in self.bus.close_after_error(reached):
                error.add_note(f"fuseloop: closing {failure}")
            if error is caught:
                raise
            raise error from caught  # the step check's error, which `caught` showed
        finally:
            if self.epoch_loop is not None:
                self.epoch_loop.close(wait=not aborted)
            self.source.close(abort=aborted)
            self.bus.close()
            self.whole = None  # it holds this Run: no cycle keeps the data alive until a GC
        return self._final(state)

    def _start(self) -> Any:
        """The first batch, the initial step state and their checks; returns the feed (None
        for a whole run). Only the carry keeps the initial state, so the first launch's
        donation lets its arrays go while the device steps. First, a model changed since
        its programs traced it (an nnx module's structure) is refused."""
        self.programs.check_model()
        self._resume()
        agree_on_mesh(self.placement.mesh)  # before anything is placed on it
        first = self._first_batch()
        fit = self.checker.fit  # what the model's init makes, for a resumed State's dtypes
        step_state, signature, spare_maker = initial_step_state(
            self.programs, self.user_state, first, isinstance(self.init_state, State), fit
        )
        step_state = strengthen_weak_leaves(self, step_state, first)  # weak_leaves.py
        verdicts = self.programs.cache.verdicts
        member = step_state if self.members is None else first_member(step_state)
        classes = warn_about_model(self.loop.program, member, first, verdicts, self.loop.metrics)
        self.checker.labels.classes(classes, labels_of(self.source.data), first)
        if self.members is None:
            self.checker.variables(step_state, signature, defer=self.jit)
        else:
            self.checker.variables(member, defer=self.jit)
        self.bus.check_start(member)
        agree_across_processes(self, first, step_state)
        self.carry.start(step_state, made_here=signature is not None, spare_maker=spare_maker)
        if self.members is not None:
            self.state = self.members.start(self.state)
        # Compiles count from here: not the init, but the `fuse="auto"` probe's (`_feed`).
        self.compiles_before = self.programs.traces
        return self._feed(step_state, first)

    def _final(self, state: State) -> State:
        return state.replace(
            step_state=self.carry.step_state, stats=self.stats, event_counts=self.bus.counts()
        )

    def _reached(self) -> State:
        """The State reached so far (an exception is leaving the run)."""
        latest = self.state
        loop = self.epoch_loop
        loop = loop if loop is not None and loop.latest is not None else None
        if loop is not None:
            latest = loop.reached()  # an epoch was under way
        if self.bus.failed_state is not None:
            latest = self.bus.failed_state  # a handler raised: the State it was given
        if loop is not None:
            latest = loop.mark_held(latest)
        if self.whole is not None:  # its carry may have run past where its replay raised
            latest = self.whole.marked_ahead(latest)
        return self._final(latest).replace(status="halted")

    # ----------------------------------------------------------------- setup
    def _resume(self) -> None:
        """The starting State, the user's initial step state, and the first epoch."""
        given, state = self.init_state, self.state
        self.user_state, self.start_epoch = given, 0
        if not isinstance(given, State):
            return
        if self.loop.program.kind == "evaluator":  # a State only supplies params
            self.user_state = given.params
            return
        self.start_epoch = max(given.history) + 1 if given.history else 0
        warn_on_resume(given, self.start_epoch, self.epochs)
        self.bus.restore_counts(given.event_counts, restarts=given.epoch == self.start_epoch)
        self.user_state = given.step_state
        self.state = state.replace(
            history={k: dict(v) for k, v in given.history.items()},
            handler_metadata=resumed_metadata(given),
            times=dict(given.times),
            # Nothing left to train: the State stays where the given one ended.
            epoch=self.start_epoch if self.start_epoch < self.epochs else given.epoch,
            iteration=0 if self.start_epoch < self.epochs else given.iteration,
            metrics=dict(given.metrics) if self.start_epoch >= self.epochs else state.metrics,
        )

    def _first_batch(self) -> Any:
        self.first_iterator: Any = self.source.epoch_iterator(self.start_epoch)
        if self.resident:
            self.dataset = place_dataset(self.source.data, self.placement, self.stats)
            # One shared device scalar per starting epoch (feeds.epoch_counter): no transfer
            self.device_epoch = epoch_counter(self.start_epoch)
            at = (self.source.data, self.dataset, self.device_epoch, self.reads, self.start_epoch)
            first = [first_resident_batch(self.programs, *at)]
        else:
            first = self.source.pull(self.first_iterator, 1)
        if not first:
            raise ValueError(self.source.empty_at_start())
        self.checker.first(first[0], self.source.data)
        self.checker.dataset(self.source.data, self.iterations)
        return first[0]

    def _feed(self, step_state: Any, first: Any) -> Any:
        plan_dispatches(self, step_state, first, warn_nonfinite)
        if self.whole is not None:
            return None
        size = self.fuse if isinstance(self.fuse, int) else None  # "auto" is resolved
        if self.resident:
            return ResidentFeed(
                self.source.data,
                self.dataset,
                size=size,
                placement=self.placement,
                programs=self.programs,
                start_epoch=self.start_epoch,
                max_in_flight=self.max_in_flight,
            )
        return HostFeed(
            self.source,
            first,
            self.first_iterator,
            size=size,
            jit=self.jit,
            placement=self.placement,
            checker=self.checker,
            programs=self.programs,
            prefetch=self.prefetch,
            max_in_flight=self.max_in_flight,
            halts=self.guard or self.bus.may_halt_in_epoch,  # before a list's last batch?
        )

    # ----------------------------------------------------------------- epochs
    def _epochs(self, signals: SignalGuard) -> State:
        status, state = self.handoff.fire(Event.STARTED, self.state)
        halted = status == HALT_LOOP
        epoch = self.start_epoch
        if self.whole is not None and not halted:
            state, halted = self.whole.epochs(state, signals)
            epoch = self.epochs  # the epoch loop below has nothing left to do
        while not halted and epoch < self.epochs:
            state, status = self._epoch(state, epoch, signals)
            self.state = state
            if status == _RAN_OUT:
                break
            epoch += 1
            # A signal after the next epoch opened reaches it at its first boundary.
            opened = self.epoch_loop is not None and self.epoch_loop.opened_for(epoch)
            halted = status == HALT_LOOP or (signals.requested and not opened)
        self.stats["compiles"] = self.programs.traces - self.compiles_before
        ended = "halted" if halted else "completed"
        state = state.replace(status=ended)
        _, state = self.handoff.fire(Event.HALTED if halted else Event.COMPLETED, state)
        self.state = state
        return state.replace(status=ended)

    def _epoch(self, state: State, epoch: int, signals: SignalGuard) -> tuple[State, str]:
        began = time.perf_counter()
        self.bus.new_epoch()
        loop = self._epoch_loop
        if not loop.opens(epoch):  # an epoch opened early already steps on fresh ones
            self.carry.reset_metrics()
        state = opening(state, epoch)
        self.state = state
        status, state = self.handoff.fire(Event.EPOCH_STARTED, state)
        self.state, stepped = state, status == CONTINUE
        if stepped:
            iterator, ahead = self._iterator(epoch), self._ahead(epoch + 1)
            status, state = loop.run(state, iterator, self.iterations, ahead)
            if status == CONTINUE and self._ran_out(epoch):
                # The State's metrics stay the last epoch's, as after any completed run.
                return state.replace(metrics=dict(state.history.get(epoch - 1, {}))), _RAN_OUT
            may_open = status == CONTINUE and not loop.opened_for(epoch + 1)
            if may_open and not signals.requested and self._may_open(epoch + 1):
                following = functools.partial(self.source.epoch_iterator, epoch + 1)
                loop.open_next(epoch + 1, following, self.iterations)
        opened_next = loop.opened_for(epoch + 1)  # a signal then reaches the next epoch
        if status == HALT_LOOP and state.handler_metadata.get(NONFINITE_KEY) is not None:
            warn_nonfinite(state)  # a fused chunk's batches after the non-finite step:
            self.source.warn_unstepped(self.source.epoch_pulled - state.iteration - 1, "nan")
        if signals.requested and not opened_next and loop.cut_short:
            status = HALT_LOOP  # a signal before the epoch's end: it is not complete
            self.source.warn_unstepped(loop.pulled_ahead(self.source.epoch_pulled), "signal")
        state = self._epoch_metrics(state, epoch, began, stepped)
        if self.members is not None:
            state, every_member_halted = self.members.epoch_end(state, epoch)
            if every_member_halted:
                status = HALT_LOOP  # every member's guard tripped: the epoch is not complete
        if status == HALT_LOOP:
            # Halted mid-epoch (a handler, a non-finite loss, a signal): the epoch is not
            # complete, so history does not record it and a resumed run redoes it.
            show_nonfinite_halt(self.bus, state)
            return state, status
        state = with_epoch_recorded(state, epoch)
        self.state = state
        event = Event.EPOCH_HALTED if status == HALT_EPOCH else Event.EPOCH_COMPLETED
        status, state = self.handoff.fire(event, state, mirror_history=True)
        if self.members is not None and self.members.after_handlers(state):
            status = HALT_LOOP  # every member has halted (e.g. a per-member early_stop)
        return state, status

    def _iterator(self, epoch: int) -> Any:
        if self._epoch_loop.opened_for(epoch):
            return None  # opened early, with its own iterator
        if epoch != self.start_epoch:
            return self.source.epoch_iterator(epoch)
        # A re-iterable's first pass opens anew after the user's handlers (docs/data.md).
        handled = reopens_first_pass(self.loop.registrations, self.source.data)
        if handled and self.source.kind == "reiterable":  # others keep theirs
            self.first_iterator = None  # (a loader's workers stop)
            self._epoch_loop.feed.drop_first_batch()
            return self.source.epoch_iterator(epoch)
        return self.first_iterator

    def _ahead(self, epoch: int) -> tuple[int, Any, int | None] | None:
        """What `EpochLoop.run` needs to open `epoch` ahead of the ending epoch's last
        replay, or None: as `_may_open`, and only where batches pulled for an epoch that
        then does not run are harmless (the replay may still halt the run).
        """
        if not (self.resident or self.source.may_open_ahead) or not self._may_open(epoch):
            return None
        return epoch, lambda: self.source.epoch_iterator(epoch), self.iterations

    def _may_open(self, epoch: int) -> bool:
        """Whether `epoch` may open before the ending one is read (`EpochLoop.open_next`):
        it will run, and nothing can act in between - no epoch handler (which may halt or
        change the State), no population, and chunks rather than live steps (whose handlers
        see the step state). The guard's flag is the ending epoch's own (`Carry.ended`): a
        halt it decides rolls the opening back (`EpochLoop`).
        """
        return (
            epoch < self.epochs
            and self.members is None
            and not self._epoch_loop.feed.live
            and not any(self.bus.has(event) for event in _EPOCH_EVENTS)
        )

    @property
    def _epoch_loop(self) -> EpochLoop:
        if self.epoch_loop is None:
            raise RuntimeError("Run: the epoch loop is built when the run starts")
        return self.epoch_loop

    def _epoch_metrics(self, state: State, epoch: int, began: float, stepped: bool) -> State:
        """The accumulators' final values (one host read), unless a handler wrote later."""
        metrics = dict(state.metrics)
        final = self.carry.epoch_metrics()  # Host read (in Carry): the epoch's end
        replay = self._epoch_loop.replay if stepped else None  # None: halted at its start
        if replay is None or replay.steps == 0 or replay.merged_through != replay.steps - 1:
            metrics.update(final)  # no handler wrote after the loop last computed them
        seconds = time.perf_counter() - began  # the epoch's wall time, its last step done
        self.epoch_ended(epoch, seconds)
        return state.replace(metrics=metrics, times={**state.times, epoch: seconds})

    def epoch_ended(self, epoch: int, seconds: float) -> None:
        """Stats at an epoch's end: its time, and the compiles so far (for its handlers)."""
        self.stats["epoch_time"][epoch] = seconds
        self.stats["compiles"] = self.programs.traces - self.compiles_before

    def _ran_out(self, epoch: int) -> bool:
        """A one-shot iterator that had nothing left for this epoch ends the run (as Keras
        does when its input runs out), warning; one that ran short of `iterations` warns."""
        # An epoch opens the next ahead of its last chunk's replay only if it stepped.
        opened_ahead = self._epoch_loop.opened_for(epoch + 1)
        stepped = self.bus.in_epoch[Event.ITERATION_COMPLETED]  # a batch put back counts
        if self.resident or opened_ahead or stepped > 0:
            short = stepped < (self.iterations or 0) and not self._epoch_loop.cut_short
            if self.source.one_shot and short and not opened_ahead:
                warn(
                    f"data ran out in epoch {epoch} after {stepped} of its "
                    f"iterations={self.iterations} batches: that epoch is short. "
                    f"{self.source.why_empty()}",
                    RuntimeWarning,
                )
            return False
        warn(
            f"data ran out at the start of epoch {epoch}: the run ends after {epoch} epoch"
            f"{'s' if epoch != 1 else ''} instead of {self.epochs}. {self.source.why_empty()}",
            RuntimeWarning,
        )
        return True
