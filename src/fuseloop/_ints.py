"""What counts as an integer argument, in one place: a Python or numpy integer, never a
bool (`True` is no count of epochs; numpy's bool is no `np.integer`)."""

from __future__ import annotations

from typing import Any, TypeGuard

import numpy as np

__all__ = ["is_int"]


def is_int(value: Any) -> TypeGuard[int | np.integer[Any]]:
    """Whether `value` is an integer argument.

    Example:
        >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
        (True, True, False, False)
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
