"""What JAX narrows on its way to the device while 64-bit mode is off (`jax_enable_x64`),
and a byte order it does not take.

float64 leaves become float32: a warning, once per run, since the values only round.
int64 and uint64 leaves become int32 and uint32: values beyond 32 bits would wrap around (a
hashed feature id 2**33 + 7 becomes 7) and the model would silently see other data, so a
batch holding such a value is refused, with the fix. Only numpy arrays are read (a jax array
is on the device already, narrowed when it was made). A big-endian array is refused with
the conversion that fixes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._warn import warn

__all__ = ["Narrowing", "native_copy", "native_order", "torch_numpy", "warnings_of_one_run"]

_WIDE_INTS = {np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32}
# In-memory datasets (`fl.data.arrays`) found in range: they hold private copies of their
# arrays, so a later run over one need not read them again.
_IN_RANGE: weakref.WeakSet[Any] = weakref.WeakSet()
# The float64 warnings already given in the outermost run, where runs nest: a training
# run's validation evaluates the same data at every epoch (`warnings_of_one_run`).
_GIVEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("_GIVEN", default=None)


@contextlib.contextmanager
def warnings_of_one_run() -> Iterator[None]:
    """The float64 warnings said in a run, shared with the runs nested in it (validation's
    evaluator, once per epoch): the same data is warned of once per outermost run. Each
    thread's run has its own (a new thread starts with no context).

    Example:
        >>> with warnings_of_one_run():
        ...     pass
    """
    if _GIVEN.get() is not None:  # a nested run: the enclosing run's warnings stand
        yield
        return
    token = _GIVEN.set(set())
    try:
        yield
    finally:
        _GIVEN.reset(token)


class Narrowing:
    """The checks of one run's data against JAX's narrowing (x64 off)."""

    def __init__(self, source: str = "data") -> None:
        self.source = source  # what gave the batches, for the warnings' messages
        self.warned_float64 = False
        self.ints = False  # the run's batches have 64-bit integer leaves to read
        self.vouched = False  # ... all drawn from a dataset found in range

    def note(self, expected: Sequence[tuple[Any, Any]]) -> None:
        """A run's first batch's `(shape, dtype)` per leaf: whether its batches are read."""
        self.ints = _narrowed_ints(expected)
        self.vouched = False

    def note_later(
        self,
        signature: Sequence[tuple[Any, Any]],
        names: Sequence[str],
        leaves: Sequence[Any],
        where: str,
    ) -> None:
        """A later batch of a new `(shape, dtype)` per leaf: its 64-bit integer leaves are
        checked now, and the run's batches read from then on (a leaf that was int32 in the
        first batch may come as int64 from a later file, and would wrap as silently)."""
        if _narrowed_ints(signature):
            self.ints = True
            self.check_ints(names, leaves, where)

    @staticmethod
    def refuse_byte_order(names: Sequence[str], expected: Sequence[tuple[Any, Any]]) -> None:
        """A big-endian numpy leaf, which JAX cannot take: a ValueError with the fix."""
        for name, (_, dtype) in zip(names, expected, strict=True):
            if isinstance(dtype, np.dtype) and dtype.byteorder not in "=|":
                raise ValueError(
                    f"data: {name} is a big-endian array (dtype {dtype.str}), which JAX does "
                    f"not take: convert it to the machine's byte order, e.g. "
                    f"{name}.astype({dtype.newbyteorder('=').name!r}) (fl.data.arrays does "
                    f"so itself)"
                )

    @property
    def reads(self) -> bool:
        """Whether a batch's 64-bit integer leaves are to be read."""
        return self.ints and not self.vouched

    def batch(self, names: Sequence[str], leaves: Sequence[Any], where: str) -> None:
        """Checks a batch's (or a stacked chunk's) 64-bit integer leaves, where needed."""
        if self.reads:
            self.check_ints(names, leaves, where)

    def dataset(self, names: Sequence[str], data: Any) -> None:
        """Checks a whole in-memory dataset (`fl.data.arrays`) once; in range, it vouches
        for the batches drawn from it."""
        if not hasattr(data, "x") or not hasattr(data, "y") or jax.config.read("jax_enable_x64"):
            return  # not an in-memory dataset, or nothing is narrowed (and nothing vouched)
        if data not in _IN_RANGE:
            self.check_ints(names, jax.tree.leaves((data.x, data.y)), "fl.data.arrays")
            _IN_RANGE.add(data)
        self.vouched = True

    def warn_float64(
        self, names: Sequence[str], leaves: Sequence[Any], source: str | None = None
    ) -> None:
        """Warns (once per run) of the float64 numpy leaves among `leaves` (of `source`,
        the argument that gave them, for the message; default: the run's)."""
        source = source or self.source
        if self.warned_float64 or jax.config.read("jax_enable_x64"):
            return
        wide = [name for name, leaf in zip(names, leaves, strict=True) if _numpy_of(leaf, "f8")]
        if not wide:
            return
        self.warned_float64 = True
        which = f"leaf {wide[0]} is" if len(wide) == 1 else f"leaves {', '.join(wide)} are"
        message = (
            f"{source}: {which} float64, but JAX runs with 64-bit mode off, so "
            f"{'it is' if len(wide) == 1 else 'they are'} cast to float32 on the device. "
            f"Convert with .astype(np.float32) (a torch tensor: .float()) to silence this "
            f"warning (or enable "
            f"jax_enable_x64 for float64 math)"
        )
        given = _GIVEN.get()
        if given is not None:
            if message in given:
                return
            given.add(message)
        warn(message, UserWarning)

    @staticmethod
    def check_ints(
        names: Sequence[str], leaves: Sequence[Any], where: str, source: str = "data"
    ) -> None:
        """Raises a ValueError where a 64-bit integer numpy leaf holds a value its 32-bit
        narrowing would change (`source`: the argument, `where`: the batch or dataset in
        it, or "", for the message)."""
        if jax.config.read("jax_enable_x64"):
            return
        for name, leaf in zip(names, leaves, strict=True):
            narrow = _WIDE_INTS.get(leaf.dtype) if isinstance(leaf, np.ndarray) else None
            if narrow is None or not leaf.size:
                continue
            low, high = leaf.min(), leaf.max()
            limits = np.iinfo(narrow)
            if low < limits.min or high > limits.max:
                beyond = int(high if high > limits.max else low)
                at = f"{source}: {where}: " if where else f"{source}: "
                raise ValueError(
                    f"{at}{name} holds {leaf.dtype} values beyond "
                    f"{np.dtype(narrow).name}'s range (e.g. {beyond}), but JAX runs with "
                    f"64-bit mode off and narrows them to {np.dtype(narrow).name} on the "
                    f"device, where they would wrap around. Map them into range on the host "
                    f"(e.g. ids % n_buckets, or a lookup table of the ids seen), or enable "
                    f"jax_enable_x64"
                )


def native_copy(leaf: Any) -> np.ndarray:
    """A copy of `leaf` in the machine's byte order (the same values; JAX takes no
    big-endian array); a torch tensor's values through `torch_numpy`."""
    tensor = torch_numpy(leaf)
    return native_order(np.array(leaf if tensor is None else tensor))


def torch_numpy(leaf: Any) -> np.ndarray | None:
    """A torch tensor's values as numpy (sharing its memory where torch can), else None.

    Through `Tensor.numpy()`, not numpy's `__array__` protocol, which warns under numpy 2
    (a DeprecationWarning per leaf and batch) and fails for a tensor that requires grad
    (its values are what a batch holds: detached) or holds bfloat16 (read as JAX's
    bfloat16, bit for bit)."""
    torch = sys.modules.get("torch")  # a tensor means torch is imported: never import it
    if torch is None or not isinstance(leaf, torch.Tensor):
        return None
    tensor = leaf.detach().cpu().resolve_conj().resolve_neg()
    if tensor.dtype == torch.bfloat16:
        return np.asarray(tensor.view(torch.int16).numpy().view(jnp.bfloat16))
    return np.asarray(tensor.numpy())


def native_order(array: np.ndarray) -> np.ndarray:
    """`array` in the machine's byte order: itself where it is already, else a converted
    copy (the same values; JAX takes no big-endian array)."""
    if array.dtype.byteorder in "=|":
        return array
    return array.astype(array.dtype.newbyteorder("="))


def _numpy_of(leaf: Any, kind: str) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype == np.dtype(kind)


def _narrowed_ints(signature: Sequence[tuple[Any, Any]]) -> bool:
    """Whether JAX narrows a 64-bit integer leaf of `signature` (x64 off)."""
    wide = any(isinstance(dtype, np.dtype) and dtype in _WIDE_INTS for _, dtype in signature)
    return wide and not jax.config.read("jax_enable_x64")
