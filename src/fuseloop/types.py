"""The types of fuseloop's public arguments, for annotating code that uses fuseloop.

Example:
    >>> import fuseloop as fl
    >>> def stop_at_two(state: fl.State) -> fl.types.Status:
    ...     return "halt_loop" if state.epoch == 2 else "continue"
"""

from ._types import (
    Accumulate,
    EventLike,
    EventName,
    FilterLike,
    FilterPredicate,
    Fuse,
    Handler,
    HandlerResult,
    Mode,
    RunStatus,
    Status,
)

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
