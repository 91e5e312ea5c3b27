"""Handlers users attach to a Loop: log, validate, monitors, checkpoints, progress, writers.

Each submodule is imported on first use, so `fl.handlers.checkpoint.list_checkpoints(path)`
works in a fresh process without `import fuseloop` loading orbax and the writers up front.

Example:
    >>> import tempfile
    >>> import fuseloop as fl
    >>> fl.handlers.checkpoint.list_checkpoints(tempfile.mkdtemp())
    []
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type checker sees each submodule's own signatures, not a ModuleType
    from . import checkpoint, log, monitor, plot, progress, validate, writers

__all__ = ["checkpoint", "log", "monitor", "plot", "progress", "validate", "writers"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
