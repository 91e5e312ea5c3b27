"""Keras-style sequences indexed by batch (`keras.utils.PyDataset`, `keras.utils.Sequence`).

Such an object has `__len__` (batches per epoch) and `__getitem__(i)` (batch `i`), and may
have `on_epoch_begin()` / `on_epoch_end()`, which Keras calls around each epoch (a common
`on_epoch_end` reshuffles). A map-style dataset (torch's `Dataset`) has the same two
methods but indexes examples, so the shape alone cannot tell them apart: a sequence is one
whose class comes from Keras or that has one of those epoch hooks (docs/data.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["BatchSequence", "is_batch_sequence"]

_KERAS_BASES = ("PyDataset", "Sequence")


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
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        return False
    if hasattr(data, "iter_epoch") or isinstance(data, (list, tuple, str, bytes, dict)):
        return False
    hooks = any(callable(getattr(data, name, None)) for name in ("on_epoch_begin", "on_epoch_end"))
    return hooks or any(
        base.__name__ in _KERAS_BASES and base.__module__.startswith(("keras", "tensorflow"))
        for base in type(data).__mro__
    )


class BatchSequence:
    """An epoch-aware source over a Keras-style sequence: epoch `e` hands out `data[0]` to
    `data[len(data) - 1]`. `on_epoch_begin()` runs before an epoch's first batch is read;
    `on_epoch_end()` runs once an epoch has handed out every batch, before the next epoch's
    first is read (so a reshuffle there cannot change a batch already handed out; after a
    run's last epoch it does not run).
    """

    def __init__(self, data: Any):
        self.data = data
        self._finished = False  # the last pass handed out every batch

    @property
    def num_batches(self) -> int:
        return len(self.data)

    def iter_epoch(self, epoch: int) -> Iterator[Any]:
        """The batches of `epoch` (the sequence's own order; `epoch` is not used)."""
        if self._finished:
            self._finished = False
            _call(self.data, "on_epoch_end")
        _call(self.data, "on_epoch_begin")
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        count = len(self.data)
        for i in range(count):
            if i == count - 1:
                self._finished = True  # handed out below: the epoch is complete
            yield self.data[i]


def _call(data: Any, hook: str) -> None:
    method = getattr(data, hook, None)
    if callable(method):
        method()
