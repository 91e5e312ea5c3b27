"""What a plain model object's `apply` may read of itself, as values to compare later.

A program compiled from `obj.apply` keeps what the trace read of `obj`: its attributes'
values at that time. Reassigning one (`obj.scale = 5.0`), changing one in place
(`obj.cfg["temperature"] = 5.0`, `obj.bias[:] = ...`, a config object's field, a fitted
scaler refit) or on the class (`Model.temperature = 5.0`) leaves the program reading the
old value. A snapshot holds each attribute as a comparable token: plain values by value
(floats by repr, so a NaN equals itself), containers element by element (a dict whatever
its order), numpy arrays by a checksum of their bytes, other objects field by field, and
what holds no value a trace could read (a logger, a lock, a thread, a host RNG, a jax
array, which cannot change, a function) by identity, kept alive so its id is not reused.
"""

from __future__ import annotations

import functools
import logging
import types
import zlib
from typing import Any

import numpy as np

__all__ = ["Snapshot"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)
_BUDGET = 200_000  # values visited per attribute; past it, the rest compares by identity
# Modules whose objects hold no value a trace reads, only state that changes as they work.
_NO_VALUES = frozenset(
    {"logging", "threading", "_thread", "multiprocessing", "queue", "asyncio", "concurrent"}
    | {"io", "_io", "socket", "subprocess", "weakref", "random", "tempfile", "tqdm"}
)


_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
_LOGGING = (logging.Logger, logging.Handler)  # a user's subclass too: its caches fill as it logs


class Snapshot:
    """`owner`'s attributes (its own and its classes' data attributes) as tokens.

    Example:
        >>> class Model:
        ...     def __init__(self): self.cfg = {"temperature": 1.0}
        >>> model = Model()
        >>> before = Snapshot(model)
        >>> model.cfg["temperature"] = 5.0
        >>> Snapshot(model).changed(before)
        ['cfg']
    """

    def __init__(self, owner: Any):
        self._kept: list[Any] = []  # what an identity token names, alive while compared
        self._budget = 0  # set for each attribute (`_safe`)
        self.tokens = {name: self._safe(value) for name, value in _attributes(owner).items()}

    def changed(self, earlier: Snapshot) -> list[str]:
        """The attributes whose token differs from `earlier`'s (added and removed too)."""
        names = self.tokens.keys() | earlier.tokens.keys()
        return sorted(n for n in names if self.tokens.get(n) != earlier.tokens.get(n))

    def _safe(self, value: Any) -> Any:
        self._budget = _BUDGET  # each attribute's own: a large one hides no other's change
        try:
            return self._token(value, 0, set())
        except Exception:  # noqa: BLE001 - an object that cannot be read compares by identity
            return self._identity(value)

    def _token(self, value: Any, depth: int, seen: set[int]) -> Any:
        self._budget -= 1
        if isinstance(value, _SCALARS):
            return (type(value).__name__, repr(value))
        if isinstance(value, np.ndarray) and not value.dtype.hasobject:
            data = np.ascontiguousarray(value).view(np.uint8).reshape(-1)
            return ("ndarray", value.dtype.str, value.shape, zlib.crc32(data.data))
        if self._budget < 0 or depth > 8 or id(value) in seen:
            return self._identity(value)
        inner = seen | {id(value)}
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(self._token(v, depth + 1, inner) for v in value))
        if isinstance(value, (set, frozenset)):
            return (type(value), frozenset(self._token(v, depth + 1, inner) for v in value))
        if isinstance(value, dict):
            return (type(value), self._fields(value, depth, inner))
        if _holds_values(value):  # a config object, a fitted scaler: its fields
            return (type(value), self._fields(vars(value), depth, inner))
        return self._identity(value)

    def _fields(self, values: dict[Any, Any], depth: int, seen: set[int]) -> Any:
        return frozenset((repr(k), self._token(v, depth + 1, seen)) for k, v in values.items())

    def _identity(self, value: Any) -> Any:
        self._kept.append(value)
        return ("id", id(value))


def _attributes(owner: Any) -> dict[str, Any]:
    """The owner's data attributes by name: its classes' (a subclass's over its base's),
    then its own over those (in `__slots__` too). Methods, properties and other descriptors
    are code, not data; a `cached_property`'s value is derived, and appears when read."""
    found: dict[str, Any] = {}
    derived = set()
    for cls in reversed(type(owner).__mro__[:-1]):  # object's own are no model's
        for name, value in vars(cls).items():
            if isinstance(value, functools.cached_property):
                derived.add(name)
            elif not name.startswith("__") and _is_data(value):
                found[name] = value
        for name in _slots(cls):
            if hasattr(owner, name):
                found[name] = getattr(owner, name)
    own = getattr(owner, "__dict__", {})
    found.update((name, value) for name, value in own.items() if name not in derived)
    return found


def _slots(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    return tuple(name for name in names if name not in ("__dict__", "__weakref__"))


def _is_data(value: Any) -> bool:
    code = (types.FunctionType, staticmethod, classmethod, property, type, types.ModuleType)
    try:
        return not isinstance(value, code) and not hasattr(value, "__get__")
    except Exception:  # noqa: BLE001 - a proxy whose attribute lookup raises: not compared
        return False


def _holds_values(value: Any) -> bool:
    """An object whose fields may be values a trace reads (a dataclass, a namespace, a
    fitted scaler, a callable normalizer), not code (a type, a module, a function) nor a
    logger, a lock or a thread (`_NO_VALUES`)."""
    if isinstance(value, (type, types.ModuleType, *_CODE, *_LOGGING)):
        return False
    return hasattr(value, "__dict__") and type(value).__module__.split(".")[0] not in _NO_VALUES
