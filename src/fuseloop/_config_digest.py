"""What processes compare of a run's configuration beyond its shapes and step: the mesh,
the metrics, each handler's own settings, and an in-memory dataset's values
(docs/distributed.md, "Mismatched configurations"). A difference in any of them trains a
different model on each process, or hangs one of them in a collective the others never
reach; compared first, it is an error naming it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._distributed import describe_values

__all__ = ["describe_handlers", "describe_mesh", "describe_metrics", "is_dataset", "source_digest"]

_SIMPLE = (bool, int, float, str, type(None))


def describe_mesh(mesh: Any) -> str:
    """The mesh's axes and its devices in order (None: the default global mesh).

    Example:
        >>> describe_mesh(None)
        'None'
    """
    if mesh is None:
        return "None"
    ids = [int(device.id) for device in np.ravel(mesh.devices)]
    return f"{dict(mesh.shape)} devices {ids}"


def describe_metrics(metrics: tuple[Any, ...]) -> list[str]:
    """Each metric's name, accumulator and function.

    Example:
        >>> from fuseloop._metrics import resolve_metric
        >>> describe_metrics((resolve_metric("accuracy", None, "running_average"),))
        ['accuracy running_average _accuracy']
    """
    return [f"{m.name} {m.accumulate} {_named(m.fn)}" for m in metrics]


def describe_handlers(registrations: tuple[Any, ...]) -> list[str]:
    """Each handler's event, name, filter and settings (for fuseloop's own handlers, the
    plain values they hold and those of the objects they hold: an early stop's patience, a
    checkpoint's path).

    Example:
        >>> from fuseloop._events import Registration, Event
        >>> describe_handlers((Registration(Event.EPOCH_COMPLETED, print, name="p"),))
        ["epoch_completed p {'after': None, ...} print {}"]
    """
    return [
        f"{r.event} {r.name} {_filter(r.filter)} {_named(r.handler)} {_settings(r.handler)}"
        for r in registrations
    ]


def source_digest(data: Any) -> str:
    """A digest of an in-memory dataset's arrays (`fl.data.arrays`: every process holds
    the whole dataset and takes its rows of one global order), kept on the source: the
    arrays are read once."""
    kept = getattr(data, "_values_digest", None)
    if kept is None:
        kept = data._values_digest = describe_values((data.x, data.y))
    return str(kept)


def is_dataset(value: Any) -> bool:
    return all(hasattr(value, name) for name in ("x", "y", "n", "batch_size"))


def _named(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def _filter(value: Any) -> str:
    return value if isinstance(value, str) else _settings(value) or _named(value)


def _settings(obj: Any, depth: int = 0) -> str:
    """The plain values `obj` holds (one level into the objects it holds), for fuseloop's
    own handlers: a user's handler may hold what differs by design (its process index)."""
    fields = getattr(obj, "__dict__", None)
    if not isinstance(fields, dict) or not type(obj).__module__.startswith("fuseloop"):
        return "{}"
    shown: dict[str, Any] = {}
    for key, value in sorted(fields.items()):
        if key.startswith("_"):
            continue
        if is_dataset(value):  # its own description: what it holds, not its counters
            shown[key] = f"n={value.n} batch_size={value.batch_size} {source_digest(value)}"
        elif isinstance(value, os.PathLike):
            shown[key] = os.fspath(value)
        elif isinstance(value, _SIMPLE) or (
            isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value)
        ):
            shown[key] = value
        elif depth == 0 and hasattr(value, "__dict__") and not callable(value):
            shown[key] = _settings(value, depth + 1)
    return repr(shown)
