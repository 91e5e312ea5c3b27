"""In-memory datasets as batch sources: `fl.data.arrays`.

`run(data, ...)` accepts lists of batches, re-iterables, callables and one-shot iterators
as they are. This module adds the source for a dataset that already sits in
memory as arrays: it batches and shuffles it, and the order of epoch `e` depends only on
`(seed, e)`, so a resumed run, a rerun and a `device=True` run all see the same batches.

Example:
    >>> import numpy as np, fuseloop as fl
    >>> source = fl.data.arrays(np.zeros((10, 3)), np.arange(10), batch_size=4)
    >>> len(source), [y.tolist() for _, y in source] == [y.tolist() for _, y in source]
    (2, True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._arg_types import is_int
from ._batch_checks import no_device_dtype, refuse_per_example_lists, refuse_python_list
from ._epoch_order import EpochOrder, checked_epoch, order_key
from ._foreign_keywords import ARRAYS_ADVICE, advise_foreign_keywords
from ._narrowing import native_copy
from ._shards import local_indices, place_rows, refuse_short_batch
from ._unsliceable import refuse_jax_sparse, refuse_unstackable

__all__ = ["arrays", "ArraySource"]

_MAX_SEED = 2**32


def _named_leaves(tree: Any, name: str) -> list[tuple[str, np.ndarray]]:
    """`(path, array)` for each leaf of `tree`, the path spelled as the user would index."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(name + jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _read_only_copy(leaf: Any) -> np.ndarray:
    copy = native_copy(leaf)
    copy.flags.writeable = False
    return copy


def _leading_size(x: Any, y: Any) -> int:
    """The shared leading-axis length of every leaf of `x` and `y`, or a ValueError."""
    for name, part in (("x", x), ("y", y)):
        refuse_python_list(part, name)
        refuse_jax_sparse(part, name)
    x_leaves = _named_leaves(x, "x")
    if not x_leaves:
        raise ValueError("x has no arrays; pass an array or a pytree (e.g. a dict) of arrays")
    sizes = {}
    for name, leaf in x_leaves + _named_leaves(y, "y"):
        refuse_unstackable(leaf, name)
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise ValueError(
                f"{name} is a scalar; every leaf of x and y needs a leading (example) axis"
            )
        sizes[name] = shape[0]
    if len(set(sizes.values())) > 1:
        refuse_per_example_lists(x, y, sizes)
        listed = [f"{name}: {size}" for name, size in sizes.items()]
        more = f", and {len(listed) - 6} more" if len(listed) > 6 else ""
        raise ValueError(
            f"x and y must share the leading (example) axis, got {', '.join(listed[:6])}"
            f"{more}; slice them to the same number of examples"
        )
    n = next(iter(sizes.values()))
    if n == 0:
        raise ValueError("x and y hold no examples (leading axis of size 0)")
    return int(n)


def _check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not is_int(value):
        raise ValueError(f"{name}={value!r} must be an int")
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name}={value!r} must be {bound}")
    return int(value)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be True or False")
    return bool(value)


class ArraySource:
    """A dataset held as arrays, served as `(x, y)` batches in a per-epoch order.

    Built by `arrays(...)`; see there for the arguments. The order of epoch `e` is
    `jax.random.permutation(jax.random.fold_in(jax.random.PRNGKey(seed), e), n)` (the
    identity when `shuffle=False`), so it depends on nothing but `(seed, e)`.

    Attributes:
        n: The number of examples.
        batch_size: Examples per batch.
        num_batches: Batches per epoch (`len(source)`).
        seed: The shuffle seed.
        shuffle: Whether epochs are shuffled.
        drop_remainder: Whether a last, short batch is dropped.
        resident: True for `device=True`: the executor may keep the dataset on the device
            and gather each chunk there (see `device_arrays` and `epoch_indices`).
        transfers_done: How many times the dataset was moved to the device (0 or 1).
        labels_checked: The loss label rules a run found `y` to hold; `y` is a read-only
            copy, so later runs do not read it again.

    Example:
        >>> import numpy as np
        >>> source = arrays(np.zeros((10, 3)), np.arange(10), batch_size=4)
        >>> source
        ArraySource(n=10, batch_size=4, num_batches=2, shuffle=True, seed=0,
                    drop_remainder=True, device=False)
        >>> len(source), [y.shape for _, y in source]
        (2, [(4,), (4,)])
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_remainder: bool,
        device: bool,
    ):
        self.shuffle = _check_bool(shuffle, "shuffle")
        self.drop_remainder = _check_bool(drop_remainder, "drop_remainder")
        self.resident = _check_bool(device, "device")
        self.in_memory = True  # batches come from host arrays: cheap to pull (see _data)
        self.seed = _check_int(seed, "seed", 0, _MAX_SEED)
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.n = _leading_size(x, y)
        # Host copies: later edits to the caller's arrays do not change the dataset.
        self.x = jax.tree.map(native_copy, x)
        self.y = jax.tree.map(_read_only_copy, y)  # read-only: its checked labels stay so
        full, remainder = divmod(self.n, self.batch_size)
        if self.drop_remainder and full == 0:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({self.n} examples) and "
                f"drop_remainder=True drops the only, short batch; use batch_size <= {self.n} "
                f"or drop_remainder=False"
            )
        self.num_batches = full if self.drop_remainder else full + (remainder > 0)
        # The examples of the short last batch each epoch ends with (0: none, or dropped).
        self.short_batch = 0 if self.drop_remainder else remainder
        self.transfers_done = 0
        # ((sharding, 64-bit mode), arrays): float64 data is float32 on the device while
        # jax_enable_x64 is off, so switching it on moves the dataset again.
        self._device_arrays: tuple[Any, tuple[Any, Any]] | None = None
        # An epoch's first batch as the host read it, by (epoch, prng_config(), x64 mode).
        self.first_batches: dict[tuple[int, Any, bool], Any] = {}
        # The label rules (`_label_rule.LabelRule`) `y` was found to hold (`_checks`): `y`
        # is a private copy, so a later run need not read it again.
        self.labels_checked: set[Any] = set()
        # Whether a validation or an evaluator already warned that the dataset leaves its
        # short last batch out (`_data.warn_left_out`): once per dataset, not per epoch.
        self.warned_left_out = False

    def __len__(self) -> int:
        return self.num_batches

    def __repr__(self) -> str:
        return (
            f"ArraySource(n={self.n}, batch_size={self.batch_size}, "
            f"num_batches={self.num_batches}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_remainder={self.drop_remainder}, device={self.resident})"
        )

    # ----------------------------------------------------------------- order
    @property
    def key_data(self) -> np.ndarray:
        """The raw `jax.random.PRNGKey(seed)` (`uint32[2]` by default), for `epoch_indices`.

        Example:
            >>> import numpy as np
            >>> arrays(np.zeros(4), np.zeros(4), batch_size=2, seed=7).key_data.tolist()
            [0, 7]
        """
        return np.asarray(jax.random.PRNGKey(self.seed))

    @property
    def order_spec(self) -> EpochOrder:
        """What the epoch orders depend on, with no arrays.

        Compiled order programs close over it rather than over the source, so they keep no
        dataset alive.

        Example:
            >>> import numpy as np
            >>> arrays(np.zeros(4), np.zeros(4), batch_size=2, seed=7).order_spec.seed
            7
        """
        return EpochOrder(self.seed, self.n, self.batch_size, self.shuffle, self.drop_remainder)

    def _permutation(self, key: Any, epoch: Any) -> jax.Array:
        return self.order_spec.permutation(key, epoch)

    def epoch_indices(self, key_data_or_seed: Any, epoch: Any) -> jax.Array:
        """`int32[num_batches, batch_size]`: the example indices of each batch of `epoch`.

        Pure and jittable (jax ops only), so a device-resident loop computes the epoch's
        order on the device from a device scalar `epoch`; the host path (`iter_epoch`)
        computes the same permutation, so both serve identical batches. Only whole
        batches are returned: a short last batch (`drop_remainder=False`) is left out.

        Args:
            key_data_or_seed: `key_data` (or a typed `jax.random.key`), the seed as a
                Python int, or the seed as a uint32 scalar array (an int32 array covers
                seeds below 2**31).
            epoch: The epoch (an int, or an int32 scalar array, traced or not).

        Example:
            >>> import numpy as np, jax
            >>> s = arrays(np.arange(8.0), np.arange(8), batch_size=4, seed=3)
            >>> idx = jax.jit(s.epoch_indices)(s.key_data, 1)
            >>> idx.shape, sorted(np.asarray(idx).ravel().tolist()) == list(range(8))
            ((2, 4), True)
        """
        key = order_key(key_data_or_seed, "key_data_or_seed")
        return self.order_spec.whole_batches(key, checked_epoch(epoch, "epoch"))

    def order(self, epoch: int) -> np.ndarray:
        """The host copy of epoch `epoch`'s permutation of the `n` examples.

        Example:
            >>> import numpy as np
            >>> source = arrays(np.zeros(5), np.zeros(5), batch_size=5, seed=2)
            >>> sorted(source.order(3).tolist()), arrays(
            ...     np.zeros(3), np.zeros(3), batch_size=1, shuffle=False).order(3).tolist()
            ([0, 1, 2, 3, 4], [0, 1, 2])
        """
        epoch = _check_int(epoch, "epoch", 0)
        # Host read: the permutation is computed with jax so it matches the device path.
        return self.order_spec.host_order(epoch)

    # ----------------------------------------------------------------- host batches
    def _take(self, index: np.ndarray) -> tuple[Any, Any]:
        take = lambda a: a[index]  # noqa: E731
        return jax.tree.map(take, self.x), jax.tree.map(take, self.y)

    def iter_epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        """The `(x, y)` numpy batches of `epoch`, in that epoch's order.

        Example:
            >>> import numpy as np
            >>> s = arrays(np.arange(6.0), np.arange(6), batch_size=3, shuffle=False)
            >>> [y.tolist() for _, y in s.iter_epoch(5)]
            [[0, 1, 2], [3, 4, 5]]
        """
        if self.short_batch:
            refuse_short_batch(self.short_batch, self.batch_size)
        order = self.order(epoch)
        for b in range(self.num_batches):
            index = order[b * self.batch_size : (b + 1) * self.batch_size]
            # Under jax.distributed each process takes its share of every global batch.
            yield self._take(local_indices(index, self.batch_size))

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self.iter_epoch(0)

    def host_labels(self) -> Any:
        """All targets, as the host holds them (for checks that must not read the device).

        Example:
            >>> import numpy as np
            >>> arrays(np.zeros(3), np.array([2, 0, 1]), batch_size=1).host_labels().tolist()
            [2, 0, 1]
        """
        return self.y

    # ----------------------------------------------------------------- device
    @property
    def device_arrays(self) -> tuple[Any, Any]:
        """The `(x, y)` pytree on the default device, moved there once (one transfer).

        Only for `device=True`; use `put(sharding)` to choose where it goes.

        Example:
            >>> import numpy as np
            >>> source = arrays(np.ones((4, 2)), np.arange(4), batch_size=2, device=True)
            >>> x, y = source.device_arrays
            >>> x.shape, source.transfers_done
            ((4, 2), 1)
        """
        return self.put()

    def put(self, sharding: Any = None) -> tuple[Any, Any]:
        """Moves the dataset to the device (or `sharding`) the first time; then reuses it.

        Each actual move adds one to `transfers_done`; calling again with the same
        `sharding` moves nothing. A `sharding` that splits the example axis over several
        devices stores each device's block of rows only (padded with zero rows to a
        multiple of the shard count; see `_shards.place_rows`), each process moving only
        its own devices' rows.

        Example:
            >>> import numpy as np
            >>> source = arrays(np.ones((4, 2)), np.arange(4), batch_size=2, device=True)
            >>> _ = source.put(); _ = source.put()
            >>> source.transfers_done
            1
        """
        if not self.resident:
            raise ValueError(
                "this source was built with device=False; pass fl.data.arrays(..., "
                "device=True) to keep the dataset on the device"
            )
        placed_as = (sharding, bool(jax.config.read("jax_enable_x64")))
        if self._device_arrays is None or self._device_arrays[0] != placed_as:
            _require_device_dtypes(self.x, self.y)
            placed: tuple[Any, Any] = place_rows((self.x, self.y), sharding)
            self._device_arrays = (placed_as, placed)
            self.transfers_done += 1
        return self._device_arrays[1]

    def gather(self, arrays_on_device: tuple[Any, Any], index: Any) -> tuple[Any, Any]:
        """The batch `index` (int32[batch_size]) of the device dataset; jittable.

        Example:
            >>> import jax, numpy as np
            >>> source = arrays(np.arange(8.0), np.arange(8), batch_size=4, device=True)
            >>> x, y = jax.jit(source.gather)(source.put(), np.array([6, 1], np.int32))
            >>> y.tolist()
            [6, 1]
        """
        take = lambda a: jnp.take(a, index, axis=0)  # noqa: E731
        x, y = arrays_on_device
        return jax.tree.map(take, x), jax.tree.map(take, y)


@advise_foreign_keywords(ARRAYS_ADVICE)
def arrays(
    x: Any,
    y: Any,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_remainder: bool = True,
    device: bool = False,
) -> ArraySource:
    """A batch source over in-memory arrays, shuffled per epoch from `(seed, epoch)`.

    Args:
        x: An array, or a pytree (e.g. a dict) of arrays, with the examples on axis 0.
        y: The targets: an array or a pytree of arrays with the same leading size.
        batch_size: Examples per batch (>= 1).
        shuffle: Shuffle each epoch. The order of epoch `e` is
            `jax.random.permutation(jax.random.fold_in(jax.random.PRNGKey(seed), e), n)`:
            it depends only on `(seed, e)`, so a resumed run and a rerun see the same order.
        seed: The shuffle seed, an int in [0, 2**32).
        drop_remainder: Drop the last batch when it would be short (so every batch has the
            same shape, as `fuse` needs). With `False` the last batch is short.
        device: Keep the whole dataset on the device (moved once); a fused run then
            gathers and shuffles each chunk there, with no host-to-device transfer per
            epoch. Any dataset size works: the remainder is dropped as on the host, or,
            with `drop_remainder=False`, the short last batch runs too, exactly as the host
            source runs it. Plain iteration still gets the same batches on the host.

    Returns:
        An `ArraySource`: `iter_epoch(e)` yields the batches of epoch `e`, `iter(source)`
        those of epoch 0, `len(source)` is the number of batches per epoch. It holds its
        own copies of `x` and `y` (later edits to yours do not reach it), `y`'s read-only:
        a run range-checks the labels once per loss, and later runs trust that.

    Raises:
        ValueError: leaves with different leading sizes (naming them), a bad `batch_size`
            (< 1, or larger than the dataset with `drop_remainder=True`) or a bad `seed`.

    Example:
        >>> import numpy as np, fuseloop as fl
        >>> x = {"image": np.zeros((64, 4, 4)), "meta": np.zeros((64, 2))}
        >>> source = fl.data.arrays(x, np.zeros(64, np.int32), batch_size=16, seed=1)
        >>> xb, yb = next(iter(source)); xb["image"].shape, yb.shape
        ((16, 4, 4), (16,))
    """
    return ArraySource(
        x, y, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder, device=device
    )


def _require_device_dtypes(x: Any, y: Any) -> None:
    """Raises a ValueError naming an array no device can hold (strings, objects).

    It names the fix, before anything is moved (the device would name only the dtype).
    """
    for name, tree in (("x", x), ("y", y)):
        wrong = no_device_dtype(tree, name)
        if wrong is not None:
            raise ValueError(f"fl.data.arrays(..., device=True): {wrong}")
