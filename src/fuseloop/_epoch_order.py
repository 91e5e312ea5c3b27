"""What an `fl.data.arrays` source's epoch orders depend on, apart from its arrays.

Compiled programs that compute an epoch's order on the device close over an `EpochOrder`,
never over the source: a Loop's program cache then keeps no dataset alive after its runs
(docs/design.md §4).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._arg_types import is_int

__all__ = [
    "EpochOrder",
    "abstract_key",
    "checked_epoch",
    "order_key",
    "prng_config",
    "prng_impl",
]


@dataclass(frozen=True)
class EpochOrder:
    """A source's order parameters: the same permutation on the host and on the device.

    Example:
        >>> import numpy as np
        >>> plan = EpochOrder(seed=0, n=5, batch_size=2, shuffle=False, drop_remainder=False)
        >>> np.asarray(plan.batches(0)).tolist()  # the short last batch padded with its own
        [[0, 1], [2, 3], [4, 4]]
    """

    seed: int
    n: int
    batch_size: int
    shuffle: bool
    drop_remainder: bool

    @property
    def layout(self) -> EpochOrder:
        """This order without its seed: what a program computing orders is compiled for.
        The seed reaches such a program as its key (`key()`), an input, so a sweep over
        seeds compiles nothing new.
        """
        return replace(self, seed=0)

    def key(self) -> np.ndarray:
        """The seed's raw PRNG key, on the host (made once per seed and PRNG kind)."""
        return _seed_key(self.seed, prng_impl())

    def permutation(self, key: Any, epoch: Any) -> jax.Array:
        """`int32[n]`: the order of every example in `epoch` (`key`: a raw PRNG key)."""
        if not self.shuffle:
            return jnp.arange(self.n, dtype=jnp.int32)
        order = jax.random.permutation(jax.random.fold_in(key, epoch), self.n)
        return order.astype(jnp.int32)

    def host_order(self, epoch: int) -> np.ndarray:
        """`permutation` of `epoch` on the host (the library's own transfers and read,
        allowed under any transfer guard).

        JAX's permutation sorts the examples by random keys, a round or two of them, and
        XLA's sort on a CPU takes about 15 ms per round for 60,000 keys (numpy: under 1).
        So the keys are drawn by JAX, as its permutation draws them, and sorted here: the
        same order, bit for bit, checked against JAX's own once per dataset size and PRNG
        kind (docs/design.md §6, "Epoch orders on the host").
        """
        with jax.transfer_guard("allow"):
            if not self.shuffle:
                return np.arange(self.n, dtype=np.int32)
            check = (self.n, prng_config())
            # A small dataset's sort costs little, and its check could pass by chance.
            if self.n < _HOST_SORT_FROM or _AGREES.get(check) is False:
                return np.asarray(self.permutation(self.key(), epoch))
            order = _sorted_by_keys(_sort_keys(self.n)(self.key(), np.int32(epoch)))
            if check not in _AGREES:
                jaxs = np.asarray(self.permutation(self.key(), epoch))
                _AGREES[check] = bool(np.array_equal(order, jaxs))
                return jaxs
            return order

    def whole_batches(self, key: Any, epoch: Any) -> jax.Array:
        """`int32[n // batch_size, batch_size]`: the examples of each whole batch."""
        order = self.permutation(key, jnp.asarray(epoch, jnp.int32))
        count = self.n // self.batch_size
        return order[: count * self.batch_size].reshape(count, self.batch_size)

    def batches(self, epoch: Any, key: Any = None) -> jax.Array:
        """The epoch's order as `int32[batches, batch_size]`, the short last batch (if kept)
        as a row padded with its own first index; pure jax, so it runs on the device.
        `key`: the seed's raw key, default `key()`.
        """
        key = self.key() if key is None else key
        whole = self.whole_batches(key, epoch)
        remainder = self.n - whole.size
        if self.drop_remainder or remainder == 0:
            return whole
        # The host path serves the permutation's tail as the last batch, in order.
        tail = self.permutation(key, epoch)[whole.size :]
        padded = jnp.concatenate([tail, jnp.full(self.batch_size - remainder, tail[0])])
        return jnp.concatenate([whole, padded[None]], axis=0)


# Whether the host's sort of JAX's keys gives JAX's permutation, by (n, prng_config()),
# and the size from which the host sorts (below it, a wrong sort could match by chance).
_AGREES: dict[tuple[Any, ...], bool] = {}
_HOST_SORT_FROM = 1024


@functools.lru_cache(maxsize=16)
def _sort_keys(n: int) -> Any:
    """A program drawing the random keys `jax.random.permutation(fold_in(key, epoch), n)`
    sorts by, one row per round, as JAX draws them: each round splits its key and draws 32
    bits per example; the rounds make ties between examples' keys unlikely."""
    rounds = int(np.ceil(3 * np.log(max(1, n)) / np.log(np.iinfo(np.uint32).max)))

    def draw(key: Any, epoch: Any) -> jax.Array:
        key, rows = jax.random.fold_in(key, epoch), []
        for _ in range(rounds):
            key, sub = jax.random.split(key)
            rows.append(jax.random.bits(sub, (n,), jnp.uint32))
        return jnp.stack(rows) if rows else jnp.zeros((0, n), jnp.uint32)

    return jax.jit(draw)


def _sorted_by_keys(keys: Any) -> np.ndarray:
    """`0..n-1` reordered by each round's keys in turn (a key per position), stably, as
    `lax.sort_key_val` reorders it."""
    keys = np.asarray(keys)
    order = np.arange(keys.shape[1], dtype=np.int32)
    positions = np.arange(keys.shape[1], dtype=np.uint64)
    for row in keys:
        # Each key with its position below it: distinct numbers, whose plain sort (SIMD,
        # 6x numpy's stable argsort) is the stable order of the keys.
        tagged = (row.astype(np.uint64) << np.uint64(32)) | positions
        order = order[(np.sort(tagged) & np.uint64(0xFFFFFFFF)).astype(np.int64)]
    return order


@functools.lru_cache(maxsize=64)
def _seed_key(seed: int, impl: str) -> np.ndarray:
    """`jax.random.PRNGKey(seed)`'s raw bits (`impl`: the PRNG kind it was made under)."""
    # Made eagerly even when first asked for inside a trace (a jitted epoch_indices with a
    # Python seed): a traced key has no host bits to keep.
    with jax.transfer_guard("allow"), jax.ensure_compile_time_eval():
        key = np.asarray(jax.random.PRNGKey(seed))
    key.flags.writeable = False  # shared by every order of this seed
    return key


def prng_impl() -> str:
    """The PRNG kind in force (`jax_default_prng_impl`): caches of keys are keyed by it."""
    return str(getattr(jax.config, "jax_default_prng_impl"))  # noqa: B009 (untyped flag)


def prng_config() -> tuple[str, bool]:
    """What JAX's random bits depend on besides the key: the PRNG kind and whether threefry
    is partitionable (`jax_threefry_partitionable`, which changes every draw). Values made
    from keys and kept across runs (epoch orders, init keys, spare states) are keyed by it:
    jax retraces its programs when it changes, but kept values do not change with it."""
    partitionable = getattr(jax.config, "jax_threefry_partitionable")  # noqa: B009
    return prng_impl(), bool(partitionable)


def abstract_key() -> jax.ShapeDtypeStruct:
    """The shape and dtype of a raw `jax.random.PRNGKey` under the PRNG kind in force:
    `uint32[2]` for JAX's default threefry, `uint32[4]` for "rbg" and "unsafe_rbg".

    Example:
        >>> abstract_key()
        ShapeDtypeStruct(shape=(2,), dtype=uint32)
    """
    key = _seed_key(0, prng_impl())
    return jax.ShapeDtypeStruct(key.shape, key.dtype)


def order_key(given: Any, argument: str) -> Any:
    """The raw PRNG key an epoch's order is drawn from: `given` is a raw key (`key_data`), a
    typed key (`jax.random.key`), a seed as an int, or a seed as an integer scalar array
    (traced or not). Anything else is a TypeError naming `argument`, not JAX's complaint
    from inside the permutation.

    Example:
        >>> order_key(3, "seed").shape
        (2,)
        >>> order_key("3", "seed")
        Traceback (most recent call last):
        ...
        TypeError: seed='3' must be a key (key_data), or a seed: an int or an integer scalar
    """
    if is_int(given):
        return jax.random.PRNGKey(int(given))
    if isinstance(given, (list, tuple)):  # key data written out, as [0, 3]
        given = np.asarray(given)
    shape, dtype = np.shape(given), getattr(given, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):  # jax.random.key
        given, dtype = jax.random.key_data(given), jnp.uint32
        shape = np.shape(given)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        shape = None  # not an integer array: refused below
    if shape == abstract_key().shape:
        return jnp.asarray(given).astype(jnp.uint32)
    if shape == ():
        return jax.random.PRNGKey(given)
    raise TypeError(
        f"{argument}{_short(given)} must be a key (key_data), or a seed: an int or an "
        "integer scalar"
    )


def checked_epoch(epoch: Any, argument: str) -> Any:
    """`epoch` as an int32 scalar: an int or an integer scalar array (traced or not); a
    float, a string or None is a TypeError naming `argument` (an epoch of 1.5 would have
    been read as 1).

    Example:
        >>> int(checked_epoch(2, "epoch"))
        2
        >>> checked_epoch(1.5, "epoch")
        Traceback (most recent call last):
        ...
        TypeError: epoch=1.5 must be an epoch number: an int or an integer scalar array
    """
    dtype = getattr(epoch, "dtype", None)
    if not is_int(epoch) and not (
        dtype is not None and jnp.issubdtype(dtype, jnp.integer) and np.shape(epoch) == ()
    ):
        raise TypeError(
            f"{argument}{_short(epoch)} must be an epoch number: an int or an integer scalar array"
        )
    return jnp.asarray(epoch, jnp.int32)


def _short(value: Any) -> str:
    """`=value` for a message: an array by its shape and dtype (a traced one has no value)."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"=<array {value.dtype}{list(value.shape)}>"
    return f"={value!r}"
