"""The event bus: counters, filters and handler calls.

Counters are plain ints: an iteration whose handlers do not fire builds no State. A fused
chunk's iteration events are replayed (`replay.py`) through the `fire_iteration` the
unfused loop calls live, which makes their event streams identical."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from .._arg_types import is_int
from .._distributed import process_index, runs_on_all_processes
from .._events import (
    CONTINUE,
    ITERATION_EVENTS,
    Event,
    Registration,
    parse_result,
)
from .._state import (
    UNFINISHED_KEY,
    State,
    records_of,
    with_epoch_recorded,
    without_restored,
    written_in_place,
)
from .._step_state_check import refuse_returned_layout

__all__ = ["EventBus"]

# Every event, its name, and whether it is also counted per epoch (counts() runs at every
# firing that has a handler: a multi-epoch replay fires many).
_COUNTED = tuple((event, event.value, event in ITERATION_EVENTS) for event in Event)
_EVENTS = tuple(Event)  # iterating the enum itself costs the host ~1 us a run


# Events whose State has no step state in any run (before the first step).
_NO_STEP = (Event.STARTED,)
_REPLAYED = (
    "; the State it was given has no step state (state.step_state and state.params are "
    "None): the event was replayed after its steps ran on the device (a fused chunk, or "
    "epochs in one dispatch). Read params on an epoch event of a run with fuse=False or "
    "fuse=K within an epoch, or attach with handle_event on an epoch event, which "
    "splits the dispatch there (docs/design.md §9)"
)


def _read_a_missing_step_state(error: BaseException, state: State, event: Event) -> bool:
    """Whether `error` looks like a handler's read of a replayed State's step state (None):
    only then does the note explain why it is None, not on every error of such a handler."""
    return (
        state.step_state is None
        and event not in _NO_STEP
        and isinstance(error, (TypeError, AttributeError))
        and "NoneType" in str(error)
    )


class EventBus:
    """Fires events to registered handlers and keeps the run's event counts."""

    def __init__(
        self, registrations: Iterable[Registration], observer: Any = None, fixed: bool = False
    ):
        """`observer` (e.g. the progress bar) is told about every run and epoch event
        (`on_event(event, state)`), about steps as they are accounted for (`advance(n,
        metrics or None)`), and closed at the end (`close()`); it never changes the run.
        `fixed`: the step state's structure is the built-in step's (a trainer's or an
        evaluator's), which a handler's returned step state must keep.
        """
        self.fixed = fixed
        self.by_event: dict[Event, list[Registration]] = defaultdict(list)
        main = process_index() == 0
        for registration in registrations:
            # An observer's side effects happen once, on process 0, unless it is marked
            # with all_processes (docs/distributed.md, "Side effects once").
            if main or not registration.observes or runs_on_all_processes(registration.handler):
                self.by_event[registration.event].append(registration)
        self.total = dict.fromkeys(_EVENTS, 0)
        self.in_epoch = dict.fromkeys(ITERATION_EVENTS, 0)
        self.observer = observer
        self.failed_state: State | None = None
        self.iteration_handlers = any(self.by_event.get(e) for e in ITERATION_EVENTS)
        # ... of which some may halt the epoch part-way (an observer, `log=`, cannot)
        self.may_halt_in_epoch = any(
            not r.observes for e in ITERATION_EVENTS for r in self.by_event.get(e, ())
        )

    def check_start(self, step_state: Any) -> None:
        """Lets each handler with a `check_start(step_state)` refuse the run's initial step
        state before anything is dispatched: what it could not check when built (the
        optimizer probed on the params, `ReduceLROnPlateau`), so a run that cannot work
        stops now, in every fuse mode, rather than at the handler's first use."""
        for registrations in self.by_event.values():
            for registration in registrations:
                check = getattr(registration.handler, "check_start", None)
                if check is not None:
                    check(step_state)

    # ----------------------------------------------------------------- counters
    def restore_counts(self, event_counts: dict[str, Any], restarts: bool = False) -> None:
        """Continues the counts of a resumed State (per-call events restart). `restarts`:
        the run starts the State's own epoch again from its first batch, so what that
        epoch fired before the State was taken is not counted: the counts are the
        uninterrupted run's at that epoch's start, and `every=` filters keep its schedule.
        """
        for event in Event:
            value = event_counts.get(event.value)
            if value is None or event in (Event.STARTED, Event.COMPLETED, Event.HALTED):
                continue
            total = int(value["total"] if isinstance(value, dict) else value)
            if restarts and isinstance(value, dict):
                total -= int(value.get("epoch", 0))
            self.total[event] = total
        ended = [event_counts.get(e.value) for e in (Event.EPOCH_COMPLETED, Event.EPOCH_HALTED)]
        if restarts and all(isinstance(n, int) for n in ended):
            # Every epoch started before this one ended, completed or halted: one more
            # start is this epoch's own.
            started = self.total[Event.EPOCH_STARTED]
            self.total[Event.EPOCH_STARTED] = min(started, sum(n for n in ended if n))

    def counts(self) -> dict[str, Any]:
        total, in_epoch = self.total, self.in_epoch
        return {
            name: {"total": total[event], "epoch": in_epoch[event]} if per_epoch else total[event]
            for event, name, per_epoch in _COUNTED
        }

    def new_epoch(self) -> None:
        for event in ITERATION_EVENTS:
            self.in_epoch[event] = 0

    def has(self, event: Event) -> bool:
        return bool(self.by_event.get(event))

    @property
    def has_iteration_handlers(self) -> bool:
        return self.iteration_handlers

    def firing_offsets(self, n: int) -> list[int]:
        """The offsets `j` in `[0, n)` of the next `n` iterations at which some iteration
        handler's counter filter passes, judged from the counters alone (every offset when
        a callable filter, which needs the State, is registered).
        """
        offsets: set[int] = set()
        for event in ITERATION_EVENTS:
            first = self.total[event] + 1
            for registration in self.by_event.get(event, ()):
                spec = registration.filter
                if spec.predicate is not None:
                    return list(range(n))
                offsets.update(spec.offsets(first, n))
        return sorted(offsets)

    def skip_iterations(self, n: int) -> None:
        """Advances iteration counters by `n` when no iteration handler is registered."""
        for event in ITERATION_EVENTS:
            self.total[event] += n
            self.in_epoch[event] += n

    # ----------------------------------------------------------------- firing
    def _call(
        self,
        event: Event,
        registrations: list[Registration],
        state: State,
        mirror_history: bool = False,
    ) -> tuple[str, State]:
        status = CONTINUE
        for registration in registrations:
            try:
                if not registration.filter.admits(state):
                    continue
                records = records_of(state) if mirror_history else None
                result = registration.handler(state)
            except BaseException as error:
                # What the run reports as the State reached; at an epoch's end it notes
                # the handlers left unfinished, which a resume from it does not redo.
                self.failed_state = (
                    _unfinished(state, registration.label)
                    if event == Event.EPOCH_COMPLETED
                    else state
                )
                error.add_note(
                    f"fuseloop: raised by handler {registration.label} on event "
                    f"'{event.value}' (epoch {state.epoch}, iteration {state.iteration}; "
                    f"counted from 0 as the State's fields are, the log's Epoch "
                    f"{state.epoch + 1}, iteration {state.iteration + 1})"
                    + (_REPLAYED if _read_a_missing_step_state(error, state, event) else "")
                )
                raise
            if registration.observes and result is not None:
                raise ValueError(
                    f"handler {registration.label} was attached with Loop.observe, so it "
                    f"only observes and must return None; it returned "
                    f"{type(result).__name__}. Attach it with Loop.handle_event to halt or "
                    f"change the State"
                )
            status, new_state = parse_result(result, registration.label)
            if records is not None and (new_state is None or new_state is state):
                new_state = written_in_place(state, records) or new_state  # Keras's logs[k] = v
            if new_state is not None:
                if not isinstance(new_state, State):
                    raise ValueError(
                        f"handler {registration.label} returned (status, "
                        f"{type(new_state).__name__}); the second element must be a State "
                        f"(use state.replace(...))"
                    )
                _check_returned(state, new_state, registration.label, self.fixed)
                if new_state.step_state is not state.step_state:
                    new_state = _without_restored_note(new_state, registration.handler)
                state = new_state
                if mirror_history:
                    state = with_epoch_recorded(state, state.epoch)
            if status != CONTINUE:
                break
        return status, state

    def fire(
        self,
        event: Event,
        state: State,
        mirror_history: bool = False,
        substitute: dict[Registration, Registration] | None = None,
    ) -> tuple[str, State]:
        """Fires an epoch- or run-level event with a complete State. `substitute` replaces
        some registrations for this firing (a device-run handler's replay, whole_run.py).
        """
        self.total[event] += 1
        registrations = [
            (substitute or {}).get(r, r)
            for r in self.by_event.get(event, ())
            if r.filter.by_count(self.total[event])
        ]
        ends_epoch = event in (Event.EPOCH_COMPLETED, Event.EPOCH_HALTED)
        if self.observer is not None and not ends_epoch:
            self.observer.on_event(event, state)
        status = CONTINUE
        if registrations:
            state = state.replace(event_counts=self.counts())
            status, state = self._call(event, registrations, state, mirror_history)
        if self.observer is not None and ends_epoch:  # shows what validation added
            self.observer.on_event(event, state)
        return status, state

    def fire_iteration(
        self,
        event: Event,
        state: State,
        iteration: int,
        metrics: Callable[[], dict[str, Any]],
        step_state: Any,
    ) -> tuple[str, State]:
        """Fires an iteration event; builds a State only if some handler's counter passes.

        `metrics()` returns this iteration's device metrics (it may read them, which is a
        host sync, so it is only called when a handler fires).
        """
        self.total[event] += 1
        self.in_epoch[event] += 1
        registrations = self.by_event.get(event)
        if not registrations:
            return CONTINUE, state
        count = self.total[event]
        firing = [r for r in registrations if r.filter.by_count(count)]
        if not firing:
            return CONTINUE, state
        merged = dict(state.metrics)
        merged.update(metrics())
        state = state.replace(
            iteration=iteration, metrics=merged, step_state=step_state, event_counts=self.counts()
        )
        return self._call(event, firing, state)

    # ----------------------------------------------------------------- observer
    @property
    def observed(self) -> bool:
        """Whether an observer (the progress bar) is told about steps."""
        return self.observer is not None

    def advance(self, n: int, metrics: dict[str, Any] | None) -> None:
        if self.observer is not None:
            self.observer.advance(n, metrics)

    def close(self) -> None:
        if self.observer is not None:
            self.observer.close()

    def close_after_error(self, state: State) -> list[str]:
        """Runs each handler marked `closes_on_error` once with `state` (the run is leaving
        by an exception, so "completed" and "halted" will not fire); returns what failed,
        for the leaving error's notes."""
        failed, called = [], set()
        for registrations in self.by_event.values():
            for registration in registrations:
                handler = registration.handler
                if not getattr(handler, "fuseloop_closes", False) or id(handler) in called:
                    continue
                called.add(id(handler))
                try:
                    handler(state)
                except Exception as error:  # noqa: BLE001 - the leaving error comes first
                    failed.append(f"{registration.label}: {type(error).__name__}: {error}")
        return failed


_COUNTERS = ("epoch", "iteration", "max_epoch", "max_iteration")


def _check_returned(given: State, returned: State, label: str, fixed: bool) -> None:
    """The loop keeps its own counters; a returned State that moves one would be ignored
    by the loop yet written into `history` under the moved epoch. Where the step is a
    built-in one (`fixed`), a returned step state keeps the structure of the one given:
    the step drops what it does not know (a custom step may carry any structure)."""
    before, after = given.step_state, returned.step_state
    if before is not None and after is None:
        raise ValueError(
            f"handler {label} returned a State whose step_state is None: the loop trains on "
            f"from the step state it returns. Change only the fields you mean to, e.g. "
            f"state.replace(metrics=...), which keeps the step state"
        )
    if fixed and before is not None and after is not None and after is not before:
        refuse_returned_layout(before, after, f"handler {label} returned a State whose step_state")
    if returned.status != given.status:
        raise ValueError(
            f"handler {label} returned a State whose status is {returned.status!r}, not "
            f"{given.status!r}: the loop sets its status. To stop, return 'halt_loop' (or "
            f"'halt_epoch'), or ('halt_loop', new_state)"
        )
    if returned.metrics is not given.metrics:
        _refuse_non_numbers(returned.metrics, label, "metrics")
    if returned.history is not given.history:
        _refuse_bad_history(returned.history, given.history, label)
    for name in _COUNTERS:
        if getattr(returned, name) != getattr(given, name):
            raise ValueError(
                f"handler {label} returned a State whose {name} is "
                f"{getattr(returned, name)!r}, not {getattr(given, name)!r}: the loop's "
                f"counters are its own. Halt with a status, keep a count of your own in "
                f"handler_metadata, or pass epochs=/iterations= to run"
            )


def _refuse_non_numbers(metrics: Any, label: str, where: str) -> None:
    """Metrics are numbers (a float, an int, or an array: a population's hold one per
    member); the history, the log, CSV and plots read them as such."""
    if not isinstance(metrics, dict):
        raise ValueError(
            f"handler {label} returned a State whose {where} is a "
            f"{type(metrics).__name__}, not a dict of metric name -> number"
        )
    for name, value in metrics.items():
        if isinstance(value, (str, bytes)) or not (
            isinstance(value, (int, float, np.number, np.bool_, np.ndarray, jax.Array))
        ):
            raise ValueError(
                f"handler {label} returned a State whose {where}[{name!r}] is {value!r}: "
                f"metrics are numbers (or arrays). Keep other values in handler_metadata"
            )


def _refuse_bad_history(history: Any, given: dict[Any, Any], label: str) -> None:
    """The history maps each epoch (an int) to that epoch's metrics; checkpoints, CSV and
    plots read it so."""
    if not isinstance(history, dict):
        raise ValueError(
            f"handler {label} returned a State whose history is a {type(history).__name__}, "
            f"not a dict of epoch -> metrics"
        )
    for epoch, metrics in history.items():
        if given.get(epoch) is metrics:
            continue  # an epoch the handler left as it was: checked when it was written
        if not is_int(epoch):
            raise ValueError(
                f"handler {label} returned a State whose history has the key {epoch!r}: "
                f"history maps epochs (ints) to that epoch's metrics. Keep other values in "
                f"handler_metadata"
            )
        _refuse_non_numbers(metrics, label, f"history[{epoch}]")


def _unfinished(state: State, label: str) -> State:
    note = {"epoch": state.epoch, "handler": label}
    return state.replace(handler_metadata={**state.handler_metadata, UNFINISHED_KEY: note})


def _without_restored_note(state: State, handler: Any) -> State:
    """`state`, a handler's, that replaced the step state: without the note that it holds
    a restored best epoch's (RESTORED_KEY), unless the handler is the one that restores it
    (early_stop's `on_end`): the note would name an epoch whose step state it is not."""
    metadata = without_restored(state.handler_metadata)
    if metadata is state.handler_metadata or getattr(handler, "restores_best", False):
        return state
    return state.replace(handler_metadata=metadata)
