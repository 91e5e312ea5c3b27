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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ._batch_sequence import BatchSequence, is_batch_sequence
from ._narrowing import torch_numpy
from ._unsliceable import refuse_unstackable, unmasked
from ._warn import warn

__all__ = ["as_host_array", "as_source", "own_copy", "Source", "warn_left_out"]

# Why a run ended holding batches it pulled and did not step, and what avoids it.
_UNSTEPPED = {
    "halt": (
        "a halt at the first epoch_started or at iteration_started comes after the pull; "
        "a run with nothing left to train pulls one to check the data",
        "or halt from iteration_completed",
    ),
    "nan": (
        "terminate_on_nan halted the fused chunk they were in at its non-finite step",
        "or fuse=False",
    ),
    "signal": (
        "the signal halted the fused run at a chunk's end, after the next chunks' batches "
        "were pulled ahead",
        "or fuse=False",
    ),
}


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

    def __init__(self, data: Any, reader: str = "run"):
        sequence = is_batch_sequence(data)
        if sequence:  # keras.utils.PyDataset and the like: read by batch index
            data = BatchSequence(data)
        self.data = data
        self.one_shot = False
        self.epoch_aware = hasattr(data, "iter_epoch")
        if self.epoch_aware:
            self.kind = "sequence" if sequence else "epoch_aware"
        elif isinstance(data, (str, bytes)) or not (callable(data) or hasattr(data, "__iter__")):
            indexed = hasattr(data, "__getitem__") and hasattr(data, "__len__")
            not_a_source = (  # predict's x may also be inputs
                f"x={type(data).__name__} is neither an array with the examples on axis 0 "
                f"(or a tuple or dict of them) nor a batch source"
                if reader == "predict"
                else f"data={type(data).__name__} is not a data source"
            )
            raise ValueError(
                f"{not_a_source}; pass a list of (x, y) "
                f"batches, a re-iterable, a callable returning an iterator, an iterator, "
                f"or fl.data.arrays(x, y, batch_size)"
                + (_MAP_STYLE if indexed and not isinstance(data, (str, bytes)) else "")
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
    def may_open_ahead(self) -> bool:
        """Whether the next epoch may open before this one's end is certain (a halt then
        rolls it back): not over a one-shot iterator (its batches), nor over a Keras-style
        sequence, whose `on_epoch_end` and `on_epoch_begin` run as an epoch opens."""
        return self.prefetch_safe and self.kind != "sequence"

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
            " (x, y) batch; a one-shot iterator yields its batches once, and this one is "
            "spent: it ran out, or an earlier run closed it (as it closes any it did not "
            "finish, an endless generator included): pass a list, or a callable returning "
            "a new one"
            if self.one_shot
            else " (x, y) batch (check batch_size against the dataset size and drop_remainder)"
        )
        return f"data is empty: the run's first epoch yielded no batch. Pass at least one{spent}"

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
            if self.epoch_aware:
                iterator = iter(self.data.iter_epoch(epoch))
            elif self.kind == "reiterable":
                iterator = iter(self.data)
            else:
                iterator = iter(self.data())
        except Exception as error:
            error.add_note(
                f"fuseloop: raised while opening the data for epoch {epoch} ({_OPENING[self.kind]})"
            )
            raise
        self._open.append(iterator)
        return iterator

    def pull(self, iterator: Iterator[Any], count: int) -> list[Any]:
        """Up to `count` batches from `iterator`, never more (exact consumption).

        Leaves that are neither numpy nor jax arrays are converted: torch tensors (from a
        DataLoader's default collate) through `Tensor.numpy()`, anything else (Python
        numbers) with `np.asarray`.
        """
        batches, error = self.pull_until_error(iterator, count)
        if error is not None:
            raise error
        return batches

    def pull_until_error(
        self, iterator: Iterator[Any], count: int, stop: Callable[[], bool] | None = None
    ) -> tuple[list[Any], Exception | None]:
        """As `pull`, but an error the source raises comes back beside the batches pulled
        before it, which the caller steps before raising it (a run pulls exactly what it
        steps, even when the source fails part-way through a chunk). `stop()` true before
        a batch is pulled ends the pull there (an aborted run's prefetch thread)."""
        error = None
        plain = type(iterator) in _PLAIN_ITERATORS
        if plain:
            # Over a list or a tuple nothing can raise: one slice, not a call per batch
            # (the host's time per batch counts at every chunk).
            batches = list(itertools.islice(iterator, count))
            self.pulled += len(batches)
            self.epoch_pulled += len(batches)
        else:
            batches, error = self._pull_each(iterator, count, stop)
        if batches and self._convert is None:
            self._convert = not _arrays_only(batches[0])
        if not (self._convert or plain):
            return batches, error  # arrays already: fl.data.arrays', or copied (`_detached`)
        # A list may mix kinds (numpy, then a torch batch): each is converted as it needs.
        first = self.epoch_pulled - len(batches)
        return [
            b if _arrays_only(b) else _converted(b, self, first + k) for k, b in enumerate(batches)
        ], error

    def _pull_each(
        self, iterator: Iterator[Any], count: int, stop: Callable[[], bool] | None
    ) -> tuple[list[Any], Exception | None]:
        # A loader may refill one buffer for every batch it yields, while the loop holds
        # several batches at once (a chunk, prefetch) or hands one to an asynchronous
        # transfer that may read it later: each batch is copied before the next is asked
        # for. In-memory sources hand out arrays nothing refills.
        detach = not self.in_memory
        batches: list[Any] = []
        for _ in range(count):
            if stop is not None and stop():
                break
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
            batches.append(self._detached(batch) if detach else batch)
            self.pulled += 1
            self.epoch_pulled += 1
        return batches, None

    def _detached(self, batch: Any) -> Any:
        return _converted(batch, self, self.epoch_pulled, _detached)

    def warn_unstepped(self, count: int, why: str = "halt") -> None:
        """Warns where a run ends holding `count` batches it pulled from a one-shot iterator
        and never stepped (`why`, a key of `_UNSTEPPED`): a halt at the run's first
        `epoch_started` or at an unfused `iteration_started` comes after the pull that tells
        whether the epoch has a next batch, and a run with nothing left to train pulls its
        first batch for the checks; the guard's halt ends a fused chunk at its non-finite
        step, and the chunk's later batches were pulled with it; a signal halts a fused run
        at a chunk's end, with the next chunks' batches pulled ahead. An iterator cannot
        take them back, so a later run over it would start after them without a word; a
        generator (one with `close()`) is closed by the run anyway."""
        if count <= 0 or not self.one_shot or hasattr(self.data, "close"):
            return
        them = "them" if count > 1 else "it"
        cause, fix = _UNSTEPPED[why]
        warn(
            f"data: the run ended holding {count} batch{'es' if count > 1 else ''} it "
            f"pulled from the one-shot iterator but did not step ({cause}); an iterator "
            f"cannot take {them} back, so a later run over the same iterator starts after "
            f"{them}. To resume exactly, pass a list or a callable returning a fresh "
            f"iterator, {fix}",
            RuntimeWarning,
        )

    def close(self, abort: bool = False) -> None:
        """Closes every iterator the run opened and did not exhaust (a generator's
        `finally` runs). On an abort (`abort`), one a prefetch thread may still be pulling
        from is left open, to be closed once collected: closing it under that thread
        would fail or block."""
        for iterator in self._open:
            close = getattr(iterator, "close", None)
            if close is None or (abort and getattr(iterator, "gi_running", True)):
                continue
            try:
                close()
            except ValueError:  # the thread entered it after all (an abort only)
                if not abort:
                    raise
        self._open.clear()


_WHY_EMPTY = {  # by the kind of source (`Source.kind`)
    "one_shot": "A one-shot iterator is consumed across epochs; pass a re-iterable or a "
    "callable returning a fresh iterator, or lower epochs",
    "callable": "The data callable returned an empty iterator for it; it is called once per "
    "epoch and must return a fresh iterator over the whole epoch each time",
    "reiterable": "Iterating the data again gave no batches (an iterable that empties "
    "itself, like an open file); pass a list, or a callable returning a fresh iterator",
    "epoch_aware": "The source's iter_epoch gave no batches for it",
    "sequence": "The sequence's len() was 0 for it (its __len__ counts the batches of an epoch)",
}
_GIVES = ", which must give an iterator of batches"
_OPENING = {
    "epoch_aware": "data.iter_epoch(epoch)" + _GIVES,
    "sequence": "the sequence's on_epoch_end() or on_epoch_begin()",
    "reiterable": "iter(data)" + _GIVES,
    "callable": "calling data()" + _GIVES,
}
_PLAIN_ITERATORS: tuple[type, ...] = (type(iter([])), type(iter(())))


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (np.ndarray, jax.Array))


def _arrays_only(batch: Any) -> bool:
    if type(batch) is tuple and len(batch) == 2 and all(map(_is_array, batch)):
        return True  # (x, y) of arrays: no walk
    return all(map(_is_array, jax.tree.leaves(batch)))


def is_python_number(value: Any) -> bool:
    """Whether `value` is a Python bool, int or float (not numpy's float64, a subclass)."""
    return type(value) in (bool, int, float)


def as_host_array(leaf: Any) -> Any:
    """`leaf` as an array: jax and numpy arrays as they are, a torch tensor by its values
    (`torch_numpy`), a Python number in JAX's default dtype for it (float32, int32 or bool
    unless x64 is on; an int beyond int32 as numpy makes it, for the range check to name),
    anything else through `np.asarray`."""
    if _is_array(leaf):
        return unmasked(leaf, "a leaf of the batch")
    if is_python_number(leaf):  # as jnp.asarray types it
        dtype = jax.dtypes.canonicalize_dtype(type(leaf))
        if type(leaf) is not int or np.iinfo(dtype).min <= leaf <= np.iinfo(dtype).max:
            return np.asarray(leaf, dtype)
    refuse_unstackable(leaf, "a leaf of the batch")
    tensor = torch_numpy(leaf)
    return np.asarray(leaf) if tensor is None else tensor


def own_copy(leaf: Any) -> Any:
    """`leaf` as an array no one else can change: jax arrays are immutable; anything else
    (numpy, torch, Python numbers) is copied into a fresh numpy array."""
    array = as_host_array(leaf)
    return array if isinstance(array, jax.Array) else np.array(array)


def _converted(batch: Any, source: Source, iteration: int, convert: Any = None) -> Any:
    """`batch` with every leaf an array (by `convert`, default `as_host_array`); a leaf that
    cannot be is told in the error's note, with the batch's epoch and iteration."""
    try:
        return jax.tree.map(as_host_array, batch) if convert is None else convert(batch)
    except Exception as error:
        error.add_note(
            f"fuseloop: raised converting a leaf of the batch for epoch {source.epoch}, "
            f"iteration {iteration} to an array; pass numpy arrays (or numbers) as leaves"
        )
        raise


_MAP_STYLE = (
    "; this one is indexed, but not iterable. If data[i] is one example (a map-style "
    "dataset), wrap it in a loader that batches it, e.g. "
    "torch.utils.data.DataLoader(data, batch_size=32), or stack its examples into arrays "
    "for fl.data.arrays. If data[i] is a whole batch (a Keras-style sequence), subclass "
    "keras.utils.PyDataset or give it an on_epoch_end method (it is then read batch by "
    "batch), or pass lambda: (data[i] for i in range(len(data)))"
)


def _detached(batch: Any) -> Any:
    if type(batch) is tuple and len(batch) == 2:  # (x, y): an array x or y without a walk
        return (_detached_part(batch[0]), _detached_part(batch[1]))
    return jax.tree.map(own_copy, batch)


def _detached_part(part: Any) -> Any:
    """x or y copied leaf by leaf: a dict, tuple or list of arrays (or None) keeps its form."""
    if isinstance(part, (np.ndarray, jax.Array)):
        return own_copy(part)
    return jax.tree.map(own_copy, part)


def as_source(data: Any, bounded: bool = False, reader: str = "run") -> Source:
    """Wraps user data in a `Source`, or raises a ValueError that says what is accepted;
    an endless sequence only where `iterations=` ends each epoch (`bounded`). `reader`:
    "run", "validate" or "predict", for the fix an error names."""
    source = data if isinstance(data, Source) else Source(data, reader)
    sequence = source.data
    if not bounded and isinstance(sequence, BatchSequence) and sequence.num_batches is None:
        fix = (
            "give run(..., iterations=N) for the batches each epoch reads (Keras's steps_per_epoch)"
            if reader == "run"
            else f"{'validation' if reader == 'validate' else 'fl.predict'} reads its data to "
            f"the end: give the sequence a num_batches (or a len())"
        )
        raise ValueError(
            f"data: {type(sequence.data).__name__} has num_batches=None and no len() (an "
            f"endless sequence), so an epoch would never end: {fix}"
        )
    return source
