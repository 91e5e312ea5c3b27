"""Warnings that point at the user's own line (docs/reliability.md §1).

A run warns from deep inside the library, at a depth that differs with the path the run
takes (fused or not, a handler or the loop). A fixed `stacklevel` then points into the
library for some paths, and Python's default filter shows a warning once per *location*:
the same problem in a second run would go unseen. `warn` points at the first frame outside
the package instead, the user's `loop.run(...)` or builder call.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)` at the first caller outside fuseloop.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("a note")
        >>> caught[0].filename.endswith("_warn.py")
        False
    """
    warnings.warn(message, category, stacklevel=_depth_outside())


def _depth_outside() -> int:
    """The `stacklevel`, as `warn` passes it, of the first frame outside the package and
    the libraries it calls into: a warning raised while a step is traced is under jax's
    frames, which a user's run called through fuseloop's."""
    inside = (_PACKAGE, *_libraries())
    frame, level = sys._getframe(2), 2  # `warn`'s caller is level 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _libraries() -> tuple[str, ...]:
    """The directories of the imported libraries fuseloop traces through."""
    found = (sys.modules.get(name) for name in ("jax", "jaxlib", "flax", "optax", "equinox"))
    files = (getattr(module, "__file__", None) for module in found if module is not None)
    return tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in files if f)
