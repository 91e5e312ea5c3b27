"""Keras-style sequences indexed by batch (`keras.utils.PyDataset`, `keras.utils.Sequence`).

Such an object has `__len__` (batches per epoch; Keras 3's `PyDataset` may give
`num_batches` instead) and `__getitem__(i)` (batch `i`), and `on_epoch_begin()` /
`on_epoch_end()`, which Keras calls around each epoch (a common `on_epoch_end` reshuffles;
Keras's base classes define both). A map-style dataset (torch's `Dataset`) has the first
two but indexes examples, so they alone cannot tell the two apart: a sequence is one with
one of those epoch hooks (docs/data.md).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from typing import Any

from ._arg_types import is_int

__all__ = ["BatchSequence", "is_batch_sequence"]


def is_batch_sequence(data: Any) -> bool:
    """Whether `data` is a Keras-style sequence of batches (see the module docstring).

    Example:
        >>> class Batches:
        ...     def __len__(self): return 2
        ...     def __getitem__(self, i): return ([i], [i])
        ...     def on_epoch_end(self): pass
        >>> is_batch_sequence(Batches()), is_batch_sequence([1, 2])
        (True, False)
    """
    sized = hasattr(data, "__len__") or hasattr(data, "num_batches")  # Keras 3: either
    if not (hasattr(data, "__getitem__") and sized):
        return False
    if hasattr(data, "iter_epoch") or isinstance(data, (list, tuple, str, bytes, dict)):
        return False
    return any(callable(getattr(data, name, None)) for name in ("on_epoch_begin", "on_epoch_end"))


# Sequences an epoch was opened over and not yet ended (`on_epoch_end` not yet run), across
# runs: a later run's first epoch ends the last one first, as a second Keras `fit` would
# find the sequence reshuffled. Keyed by identity, not equality or hash: a dataclass is
# unhashable, and two equal sequences are still two. A weak reference lets a sequence go
# (its entry with it); one that takes none is held until the process ends.
_OPEN: dict[int, Any] = {}


class BatchSequence:
    """An epoch-aware source over a Keras-style sequence of batches.

    Epoch `e` hands out `data[0]` to `data[n - 1]` (`n`: its `num_batches` where that is an
    int, else `len(data)`; a `num_batches` of None reads until `iterations=` ends the
    epoch). `on_epoch_begin()` runs before an epoch's first batch is read; `on_epoch_end()`
    runs for every epoch opened, when the next one opens (in this run or a later one over
    the same sequence), so a reshuffle there cannot change a batch already handed out.
    """

    def __init__(self, data: Any):
        self.data = data

    @property
    def num_batches(self) -> int | None:
        """Batches per epoch, None where the sequence does not say (an endless one)."""
        count = getattr(self.data, "num_batches", None)
        if is_int(count):
            return int(count)
        sized = callable(getattr(self.data, "__len__", None))  # `__len__ = None`: none
        return len(self.data) if sized and count is None else None

    def iter_epoch(self, epoch: int) -> Iterator[Any]:
        """The batches of `epoch` (the sequence's own order; `epoch` is not used)."""
        if self._opened():
            _call(self.data, "on_epoch_end")
        _call(self.data, "on_epoch_begin")
        self._mark_open()
        count = self.num_batches
        indices = range(count) if count is not None else itertools.count()
        return (self.data[i] for i in indices)

    def _opened(self) -> bool:
        held = _OPEN.get(id(self.data))
        if isinstance(held, weakref.ref):
            held = held()
        return held is self.data

    def _mark_open(self) -> None:
        key = id(self.data)
        try:
            _OPEN[key] = weakref.ref(self.data, lambda _: _OPEN.pop(key, None))
        except TypeError:  # no weak references (__slots__ without __weakref__)
            _OPEN[key] = self.data


def _call(data: Any, hook: str) -> None:
    """Runs the sequence's `hook` method, where it has one."""
    method = getattr(data, hook, None)
    if callable(method):
        method()
