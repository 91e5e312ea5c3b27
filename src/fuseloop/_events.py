"""Event names, filters, halt statuses and the handler return protocol.

A filter is evaluated from counters alone wherever it can be, so the fused loop can
decide which iterations need a State without building one for every iteration.
"""

from __future__ import annotations

import difflib
import enum
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ._arg_types import refuse_signature

__all__ = [
    "Event",
    "Filter",
    "Registration",
    "attached",
    "closes_on_error",
    "event_total",
    "marked_objects",
    "normalize_event",
    "make_filter",
    "parse_result",
    "reopens_first_pass",
]


class Event(enum.StrEnum):
    """The events a loop fires, in the order a plain run fires them.

    Example:
        >>> Event.EPOCH_COMPLETED == "epoch_completed"
        True
    """

    STARTED = "started"
    EPOCH_STARTED = "epoch_started"
    ITERATION_STARTED = "iteration_started"
    ITERATION_COMPLETED = "iteration_completed"
    EPOCH_COMPLETED = "epoch_completed"
    EPOCH_HALTED = "epoch_halted"
    HALTED = "halted"
    COMPLETED = "completed"


ITERATION_EVENTS = (Event.ITERATION_STARTED, Event.ITERATION_COMPLETED)
EVENT_NAMES = tuple(e.value for e in Event)

CONTINUE: Final = "continue"
HALT_EPOCH: Final = "halt_epoch"
HALT_LOOP: Final = "halt_loop"
STATUSES = (CONTINUE, HALT_EPOCH, HALT_LOOP)

_FILTER_KEYS = ("every", "before", "after", "once")


def event_total(event_counts: Mapping[str, Any], event: str) -> int:
    """How many times `event` fired, from a State's `event_counts` (an iteration event's
    entry is `{"total": n, "epoch": n}`, another's an int; absent: 0).

    Example:
        >>> event_total({"iteration_completed": {"total": 7, "epoch": 3}}, "iteration_completed")
        7
    """
    value = event_counts.get(event, 0)
    return int(value.get("total", 0) if isinstance(value, dict) else value)


def normalize_event(
    event: Any, argument: str = "event", hint: Callable[[Any], str] | None = None
) -> Event:
    """Returns the `Event` for a name or an `Event`, or raises a ValueError naming `argument`
    (and `hint(event)`, what the caller's positional slot is often mistaken for, where the
    value is no misspelt event)."""
    try:
        return Event(event.value if isinstance(event, Event) else event)
    except (ValueError, TypeError):
        meant = _meant(event) or (hint(event) if hint is not None else "")
        raise ValueError(
            f"{argument}={_shown(event)} is not an event; accepted values: "
            f"{', '.join(EVENT_NAMES)}{meant}"
        ) from None


_HALTS = " (a run that halts fires 'halted' instead: register for both)"
# Other libraries' names for the events (Keras callbacks, Lightning hooks), less any
# "on_", "train_" or "fit_" prefix.
_HOOKS = {
    "begin": "'started'",
    "start": "'started'",
    "end": f"'completed'{_HALTS}",
    "epoch_begin": "'epoch_started'",
    "epoch_start": "'epoch_started'",
    "epoch_end": "'epoch_completed' (an epoch a handler halts fires 'epoch_halted')",
    "batch_begin": "'iteration_started'",
    "batch_start": "'iteration_started'",
    "batch_end": "'iteration_completed'",
}


def _shown(value: Any) -> str:
    """`value` for a message: an array by its dtype and shape, not its entries."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and shape and dtype is not None:
        return f"<{type(value).__name__} of {dtype} {shape}>"
    shown = repr(value)
    return shown if len(shown) <= 80 else f"{shown[:77]}..."


def _meant(value: Any) -> str:
    """The event a value given for one likely means: a close name, or another library's
    name for it; several names where one goes; a handler where the event goes."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return "; one event per call: register the handler once for each event"
    if callable(value):
        return "; the event comes before the handler"
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, EVENT_NAMES, 1, 0.8)
    if close:
        return f"; did you mean {close[0]!r}?"
    bare = value.removeprefix("on_").removeprefix("train_").removeprefix("fit_")
    hook = _HOOKS.get(bare)
    return f"; fuseloop's name for {value!r} is {hook}" if hook else ""


@dataclass(frozen=True)
class Filter:
    """When a handler fires, as a function of the event's count (1-based; a resumed run
    goes on from the saved count).

    `every=n` fires on counts 1, n+1, 2n+1, ...; `before=n` on counts < n; `after=n` on
    counts > n; `once=n` on count n only. Keys combine with AND. A `predicate` (a callable
    filter) needs the State, so it is only consulted once the counter keys pass.
    """

    every: int | None = None
    before: int | None = None
    after: int | None = None
    once: int | None = None
    predicate: Callable[[Any], bool] | None = None

    def by_count(self, count: int) -> bool:
        """Whether the counter keys pass for `count` (the predicate is not consulted)."""
        if self.every is not None and (count - 1) % self.every != 0:
            return False
        if self.before is not None and not count < self.before:
            return False
        if self.after is not None and not count > self.after:
            return False
        return self.once is None or count == self.once

    def offsets(self, first: int, n: int) -> range:
        """The offsets `j` in `[0, n)` whose count `first + j` the counter keys pass (the
        same as `by_count`, computed as one range instead of n tests)."""
        low, high = first, first + n  # counts in [low, high)
        if self.after is not None:
            low = max(low, self.after + 1)
        if self.before is not None:
            high = min(high, self.before)
        if self.once is not None:
            low, high = max(low, self.once), min(high, self.once + 1)
        if low >= high:
            return range(0)
        if self.every is None:
            return range(low - first, high - first)
        start = low + (1 - low) % self.every  # the first count c >= low with (c-1) % every == 0
        return range(start - first, high - first, self.every)

    @property
    def needs_state(self) -> bool:
        return self.predicate is not None

    def admits(self, state: Any) -> bool:
        """Whether the predicate (if any) lets its handler fire on `state`. A result that
        is not a bool is refused: `lambda s: s.iteration % 10` would fire on every
        iteration but the tenth, and a predicate returning None would never fire."""
        if self.predicate is None:
            return True
        verdict = self.predicate(state)
        if isinstance(verdict, (bool, np.bool_)):
            return bool(verdict)
        if getattr(verdict, "dtype", None) == np.bool_ and np.size(verdict) == 1:
            return bool(verdict)  # host read: a 0-d boolean jax or numpy array
        name = getattr(self.predicate, "__name__", type(self.predicate).__name__)
        raise TypeError(
            f"filter {name} returned {verdict!r} ({type(verdict).__name__}); a callable "
            f"filter returns True to fire its handler and False to skip it, e.g. "
            f"lambda s: s.iteration % 10 == 0"
        )


ALWAYS = Filter()


def make_filter(spec: Any, argument: str = "filter") -> Filter:
    """Turns a user filter (`"always"`, `"first"`, a dict, or a callable) into a `Filter`."""
    if isinstance(spec, Filter):
        return spec
    if spec is None or spec == "always":
        return ALWAYS
    if spec == "first":
        return Filter(once=1)
    if callable(spec):
        refuse_signature(spec, argument, f"{argument}(state)")
        return Filter(predicate=spec)
    if isinstance(spec, Mapping):
        unknown = set(spec) - set(_FILTER_KEYS)
        if unknown or not spec:
            raise ValueError(
                f"{argument}={spec!r} has unknown or no keys {sorted(map(str, unknown))}; "
                f"accepted keys: {', '.join(_FILTER_KEYS)}"
            )
        for key, value in spec.items():
            # Any integer type counts (a count computed with numpy is an np.int64); a bool not.
            integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            if not integer or value < 1:
                raise ValueError(
                    f"{argument}[{key!r}]={value!r} must be a positive int (counts start at 1)"
                )
        counts: dict[str, Any] = {str(k): int(v) for k, v in spec.items()}
        return Filter(**counts)
    raise ValueError(
        f"{argument}={spec!r} is not a filter; accepted values: 'always', 'first', "
        f"a dict with keys {', '.join(_FILTER_KEYS)}, or a callable(state) -> bool"
    )


@dataclass(frozen=True)
class Registration:
    """One handler attached to one event. An `observes` handler (`Loop.observe`) only
    looks: it must return None, so a multi-epoch dispatch never has to end for it. An
    `own` one was attached by one of fuseloop's builders (validate, checkpoint, a log or
    writer, a monitor's companions): it changes none of the run's data, so a `started`
    handler of its kind makes a run open its first pass again only where it reads that
    data itself (`reopens_first_pass`, docs/data.md).
    """

    event: Event
    handler: Callable[[Any], Any]
    filter: Filter = ALWAYS
    name: str = ""
    observes: bool = False
    own: bool = False

    @property
    def label(self) -> str:
        return self.name or getattr(self.handler, "__qualname__", None) or repr(self.handler)


def attached(event: Event, handler: Any, filter: Filter, name: str) -> tuple[Registration, ...]:
    """`handler` on `event`, and the handlers it comes with: a handler object whose work
    spans the run (an `EarlyStopping` with `restore_best`, which hands back the best
    epoch's step state when the run ends) names them in `fuseloop_companions(name)`, so
    attaching it with `handle_event` does what its `Loop` builder does."""
    # Looked up on the type: a mock (or any object answering every attribute) has none.
    companions = getattr(type(handler), "fuseloop_companions", None)
    extra = companions(handler, name) if callable(companions) else ()
    return (Registration(event, handler, filter, name), *extra)


def marked_objects(handler: Any, marker: str, held: bool = True) -> list[Any]:
    """The objects behind `handler` whose class sets `marker` and which keep it true: the
    handler itself, a bound method's object, and (`held`) one a wrapper function holds
    (`all_processes(saver.begin)`, a writer's closures). Read on the type first: a mock
    answers every attribute."""
    found = [handler, getattr(handler, "__self__", None)]
    for cell in (getattr(handler, "__closure__", None) or ()) if held else ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        found += [value, getattr(value, "__self__", None)]
    return [o for o in found if getattr(type(o), marker, False) and getattr(o, marker, False)]


def closes_on_error(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Marks a "completed"/"halted" handler that releases something (a writer's file, an
    asynchronous save) to run also when the run leaves by an exception, once, with the
    State reached (`EventBus.close_after_error`)."""

    def closing(state: Any) -> Any:
        return handler(state)

    closing.fuseloop_closes = True  # type: ignore[attr-defined]
    closing.__qualname__ = getattr(handler, "__qualname__", "closing")
    return closing


def parse_result(result: Any, label: str) -> tuple[str, Any]:
    """Splits a handler's return value into `(status, new_state_or_None)`.

    A handler returns None, a status string, or `(status, new_state)`.
    """
    if result is None:
        return CONTINUE, None
    if isinstance(result, str):
        if result not in STATUSES:
            raise ValueError(
                f"handler {label} returned status {result!r}; accepted values: "
                f"{', '.join(STATUSES)}"
            )
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str):
        status, new_state = result
        if status not in STATUSES:
            raise ValueError(
                f"handler {label} returned status {status!r}; accepted values: "
                f"{', '.join(STATUSES)}"
            )
        return status, new_state
    if isinstance(result, tuple) and len(result) == 2:
        first = result[0]
        # Named by its type: a State's repr holds every array of its step state.
        shown = repr(first) if isinstance(first, (int, float, type(None))) else type(first).__name__
        raise ValueError(
            f"handler {label} returned a pair whose first item is {shown}, not a "
            f"status; a pair is (status, new_state), with status one of {', '.join(STATUSES)} "
            f"(e.g. ('continue', state.replace(...)))"
        )
    raise ValueError(
        f"handler {label} returned {type(result).__name__}; a handler returns None, a status "
        f"({', '.join(STATUSES)}) or (status, new_state)"
    )


def reopens_first_pass(registrations: Iterable[Registration], data: Any) -> bool:
    """Whether a run over `data` opens its first epoch's pass again after the `started`
    and `epoch_started` handlers (docs/data.md): some handler there may change the data,
    one of the user's, or one of fuseloop's own that reads `data` itself (a validation on
    the training data). Read from all the loop's registrations, so every process decides
    alike (an observer runs on process 0 only)."""
    for r in registrations:
        if r.event not in (Event.STARTED, Event.EPOCH_STARTED):
            continue
        # The handler itself (validate's, not its start check, which reads no loader).
        readers = marked_objects(r.handler, "fuseloop_reads_data", held=False)
        if not r.own or any(reader.data is data for reader in readers):
            return True
    return False
