"""The types of fuseloop's public arguments: the string options, handlers and filters.

String options are `Literal`s, so a type checker catches `mode="mn"` or an event name with
a typo before a run does; handlers and filters are `Protocol`s, as optax types its
transformations' `init` and `update` functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol, TypeAlias

# Imported when the program runs, not only for a type checker: the aliases below are real
# typing objects, which `typing.get_type_hints` and `X | None` in a user's code evaluate.
from ._events import Event, Filter
from ._state import RunStatus, State  # RunStatus is defined beside State; re-exported here

__all__ = [
    "Accumulate",
    "EventLike",
    "EventName",
    "FilterLike",
    "FilterPredicate",
    "Fuse",
    "Handler",
    "HandlerResult",
    "Mode",
    "RunStatus",
    "Status",
]

EventName: TypeAlias = Literal[
    "started",
    "epoch_started",
    "iteration_started",
    "iteration_completed",
    "epoch_completed",
    "epoch_halted",
    "halted",
    "completed",
]
"""The events a loop fires, by name (`fl.Event` holds the same values)."""

EventLike: TypeAlias = Event | EventName
"""An event argument: an `fl.Event` or its name."""

Status: TypeAlias = Literal["continue", "halt_epoch", "halt_loop"]
"""What a handler asks of the loop: go on, end the epoch, or end the run."""


Accumulate: TypeAlias = Literal["running_average", "running_sum"]
"""How `Loop.metric` accumulates a metric over an epoch."""

Mode: TypeAlias = Literal["min", "max", "auto"]
"""Whether a monitored metric improves downwards (a loss) or upwards (an accuracy); "auto"
reads it from the name's words ("max" for accuracy, precision, recall, AUC, F1, R2, ...;
"min" for a loss, an error, MSE, ...; refused for a name that says neither)."""

Fuse: TypeAlias = bool | int | Literal["auto", "run"]
"""`Loop.run(fuse=...)`: False (one dispatch per step), True (32), a chunk size, "auto"
(the cost model's chunk size; whole epochs per dispatch on resident data when that chunk is
longer than an epoch), or "run" (as many epochs per dispatch as the handlers allow)."""

HandlerResult: TypeAlias = None | Status | tuple[Status, State]
"""A handler's return: None (continue), a status, or a status and a replacement State."""


class Handler(Protocol):
    """An event handler: called with the State when its event fires (and its filter passes).

    Example:
        >>> def stop_after_two_epochs(state: fl.State) -> Status:
        ...     return "halt_loop" if state.epoch >= 1 else "continue"
        >>> handler: Handler = stop_after_two_epochs
        >>> loop.handle_event("epoch_completed", handler).run(batches, epochs=5).epoch
        1
    """

    def __call__(self, state: State, /) -> HandlerResult:
        """Looks at (or replaces) the State; returns what the loop should do next."""
        ...


class FilterPredicate(Protocol):
    """A callable filter: whether a handler fires on this State.

    Example:
        >>> late: FilterPredicate = lambda state: state.epoch >= 1
        >>> seen = []
        >>> state = loop.handle_event("epoch_completed", lambda s: seen.append(s.epoch),
        ...                           filter=late).run(batches, epochs=3)
        >>> seen
        [1, 2]
    """

    def __call__(self, state: State, /) -> bool:
        """True when the handler should run."""
        ...


FilterLike: TypeAlias = Literal["always", "first"] | Mapping[str, int] | FilterPredicate | Filter
"""A `filter` argument: "always", "first", counts such as `{"every": 5}`, or a predicate."""
