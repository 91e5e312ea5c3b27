"""The types of fuseloop's public arguments, for annotating code that uses fuseloop.

Every name in `fuseloop._types.__all__` is re-exported here, so the two lists cannot drift.

Example:
    >>> import fuseloop as fl
    >>> def stop_at_two(state: fl.State) -> fl.types.Status:
    ...     return "halt_loop" if state.epoch == 2 else "continue"
"""

from ._types import *  # noqa: F403 - the public types, exactly `_types.__all__`
from ._types import __all__ as __all__
