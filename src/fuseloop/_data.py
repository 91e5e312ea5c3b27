"""Data sources: what `run(data, ...)` accepts, and exact, closing consumption.

Kinds of data:
  * a list of batches, or any re-iterable: a fresh pass each epoch;
  * a callable returning an iterator: called once per epoch;
  * a one-shot iterator or generator: consumed across epochs;
  * an epoch-aware source such as `fl.data.arrays`: `iter_epoch(epoch)` per epoch, so the
    order of epoch `e` depends only on the source's seed and `e`.
"""

from __future__ import annotations

import collections.abc
import itertools
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ._warn import warn

__all__ = ["as_source", "Source", "warn_left_out"]


def warn_left_out(data: Any, who: str, where: str, fix: str) -> None:
    """Warns, once per dataset, where an `fl.data.arrays` dataset that drops its short last
    batch leaves examples out of `where` (metrics that are meant to cover every example).
    """
    if not getattr(data, "drop_remainder", False) or getattr(data, "warned_left_out", True):
        return
    left_out = data.n % data.batch_size
    if left_out:
        data.warned_left_out = True
        warn(
            f"{who}: data drops its short last batch (drop_remainder=True), so {left_out} of "
            f"its {data.n} examples are left out of {where}; {fix}",
            UserWarning,
        )


class Source:
    """Hands out one iterator per epoch and closes what the run stopped reading early."""

    def __init__(self, data: Any):
        self.data = data
        self.one_shot = False
        self.epoch_aware = hasattr(data, "iter_epoch")
        if self.epoch_aware:
            self.kind = "epoch_aware"
        elif isinstance(data, (str, bytes)) or not (callable(data) or hasattr(data, "__iter__")):
            raise ValueError(
                f"data={type(data).__name__} is not a data source; pass a list of (x, y) "
                f"batches, a re-iterable, a callable returning an iterator, an iterator, "
                f"or fl.data.arrays(x, y, batch_size)"
            )
        elif isinstance(data, collections.abc.Iterator):  # never iter(): it may open a pass
            self.kind, self.one_shot = "one_shot", True
        elif hasattr(data, "__iter__"):
            self.kind = "reiterable"
        else:
            self.kind = "callable"
        self._open: list[Iterator[Any]] = []
        self.pulled = 0
        self.epoch = 0  # for notes on errors raised by the source
        self.epoch_pulled = 0
        self._convert: bool | None = None  # decided by the first batch

    @property
    def prefetch_safe(self) -> bool:
        """Whether pulling a batch that is never stepped is harmless."""
        return not self.one_shot

    @property
    def in_memory(self) -> bool:
        """Batches already in host memory (a list, or `fl.data.arrays`): pulling one is so
        cheap that a producer thread would only add GIL hand-offs, so the loop prepares the
        next chunk in its own thread while the device runs the current one."""
        return isinstance(self.data, (list, tuple)) or getattr(self.data, "in_memory", False)

    @property
    def epoch_length(self) -> int | None:
        """The batches each epoch hands out, where the source says so reliably (a list or
        tuple, `fl.data.arrays`); None where only the end of its pass tells. Knowing it, a
        run knows an epoch is over at its last step, as a fused chunk that comes up short
        does, without asking the source for one more batch."""
        if isinstance(self.data, (list, tuple)):
            return len(self.data)
        length = getattr(self.data, "num_batches", None) if self.epoch_aware else None
        return length if isinstance(length, int) else None

    def empty_at_start(self) -> str:
        """The error for a first epoch that yielded no batch, for this kind of source."""
        spent = (
            "; a one-shot iterator yields its batches once, and this one was already used "
            "up (by an earlier run?): pass a list, or a callable returning a fresh iterator"
            if self.one_shot
            else " (check batch_size against the dataset size and drop_remainder)"
        )
        return (
            f"data is empty: the first epoch yielded no batch. Pass at least one (x, y) "
            f"batch{spent}"
        )

    def why_empty(self) -> str:
        """What to do about an epoch that found no batches, for this kind of source."""
        return _WHY_EMPTY[self.kind]

    def epoch_iterator(self, epoch: int) -> Iterator[Any]:
        """The iterator for `epoch`; the previous epoch's is closed if it was not finished."""
        self.epoch, self.epoch_pulled = epoch, 0
        if self.one_shot:
            if not self._open:
                self._open.append(self.data)
            return self.data
        self.close()
        try:
            if self.kind == "epoch_aware":
                iterator = iter(self.data.iter_epoch(epoch))
            elif self.kind == "reiterable":
                iterator = iter(self.data)
            else:
                iterator = iter(self.data())
        except Exception as error:
            error.add_note(
                f"fuseloop: raised while opening the data for epoch {epoch} "
                f"({_OPENING[self.kind]}, which must give an iterator of batches)"
            )
            raise
        self._open.append(iterator)
        return iterator

    def pull(self, iterator: Iterator[Any], count: int) -> list[Any]:
        """Up to `count` batches from `iterator`, never more (exact consumption).

        Leaves that are neither numpy nor jax arrays (torch tensors from a DataLoader's
        default collate, Python lists) are converted with `np.asarray`.
        """
        batches, error = self.pull_until_error(iterator, count)
        if error is not None:
            raise error
        return batches

    def pull_until_error(
        self, iterator: Iterator[Any], count: int
    ) -> tuple[list[Any], Exception | None]:
        """As `pull`, but an error the source raises comes back beside the batches pulled
        before it, which the caller steps before raising it (a run pulls exactly what it
        steps, even when the source fails part-way through a chunk)."""
        error = None
        if type(iterator) in _PLAIN_ITERATORS:
            # Over a list or a tuple nothing can raise: one slice, not a call per batch
            # (the host's time per batch counts at every chunk).
            batches = list(itertools.islice(iterator, count))
            self.pulled += len(batches)
            self.epoch_pulled += len(batches)
        else:
            batches, error = self._pull_each(iterator, count)
        if batches and self._convert is None:
            self._convert = not all(map(_is_array, jax.tree.leaves(batches[0])))
        if self._convert:
            return [jax.tree.map(_as_array, batch) for batch in batches], error
        return batches, error

    def _pull_each(self, iterator: Iterator[Any], count: int) -> tuple[list[Any], Exception | None]:
        # A loader may refill one buffer for every batch it yields, while the loop holds
        # several batches at once (a chunk, prefetch) or hands one to an asynchronous
        # transfer that may read it later: each batch is copied before the next is asked
        # for. In-memory sources hand out arrays nothing refills.
        detach = not self.in_memory
        batches: list[Any] = []
        for _ in range(count):
            try:
                batch = next(iterator)
            except StopIteration:
                break
            except Exception as error:  # noqa: BLE001 - handed to the caller with its note
                error.add_note(
                    f"fuseloop: raised by the data source while pulling the batch for epoch "
                    f"{self.epoch}, iteration {self.epoch_pulled}"
                )
                return batches, error
            batches.append(_detached(batch) if detach else batch)
            self.pulled += 1
            self.epoch_pulled += 1
        return batches, None

    def close(self) -> None:
        """Closes every iterator the run opened and did not exhaust (a generator's
        `finally` runs)."""
        for iterator in self._open:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        self._open.clear()


_WHY_EMPTY = {  # by the kind of source (`Source.kind`)
    "one_shot": "A one-shot iterator is consumed across epochs; pass a re-iterable or a "
    "callable returning a fresh iterator, or lower epochs",
    "callable": "The data callable returned an empty iterator for it; it is called once per "
    "epoch and must return a fresh iterator over the whole epoch each time",
    "reiterable": "Iterating the data again gave no batches (an iterable that empties "
    "itself, like an open file); pass a list, or a callable returning a fresh iterator",
    "epoch_aware": "The source's iter_epoch gave no batches for it",
}
_OPENING = {
    "epoch_aware": "data.iter_epoch(epoch)",
    "reiterable": "iter(data)",
    "callable": "calling data()",
}
_PLAIN_ITERATORS: tuple[type, ...] = (type(iter([])), type(iter(())))


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, jax.Array))


def _as_array(leaf: Any) -> Any:
    return leaf if _is_array(leaf) else np.asarray(leaf)


def _own_copy(leaf: Any) -> Any:
    """`leaf` as an array no one else can change: jax arrays are immutable; anything else
    (numpy, torch, Python numbers) is copied into a fresh numpy array."""
    return leaf if isinstance(leaf, jax.Array) else np.array(leaf)


def _detached(batch: Any) -> Any:
    if type(batch) is tuple and len(batch) == 2:  # (x, y): an array x or y without a walk
        return (_detached_part(batch[0]), _detached_part(batch[1]))
    return jax.tree.map(_own_copy, batch)


def _detached_part(part: Any) -> Any:
    """x or y copied leaf by leaf: a dict, tuple or list of arrays (or None) keeps its form."""
    if isinstance(part, (np.ndarray, jax.Array)):
        return _own_copy(part)
    return jax.tree.map(_own_copy, part)


def as_source(data: Any) -> Source:
    """Wraps user data in a `Source`, or raises a ValueError that says what is accepted."""
    if isinstance(data, Source):
        return data
    return Source(data)
