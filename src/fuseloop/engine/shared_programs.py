"""Programs that depend on no Loop, shared by every Loop of the process.

A resident source's epoch order and first batch, the carry's pack and unpack, and zeroed
metric accumulators depend only on shapes and names (an order's layout, a tree's
structure, the metrics' names), never on a model, loss or optimizer. Built once per
process and key, a new Loop over the same data (a sweep that builds a trainer per setting,
a test suite) traces, lowers and compiles none of them again; jax's own caches, keyed by
these jitted functions, do the rest. Each Loop's `ProgramCache` still names the programs
it used (docs/design.md §4). The caches are bounded: a key is a few small values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._epoch_order import EpochOrder
from .._metrics import MetricSpec
from .._shards import take_rows
from .._step import init_tail
from .packing import pack_leaves, unpacker
from .population import population_tail

__all__ = ["epoch_order", "first_batch", "fresh_tail", "pack", "unpack"]


@functools.lru_cache(maxsize=64)
def epoch_order(layout: EpochOrder, prng: Any) -> Callable[[Any, Any], tuple[Any, Any, Any]]:
    """`(epoch, key) -> (order, epoch + 1, cursor 0)` for orders of `layout` under `prng`
    (`prng_config()`; the seed's raw key is an input: a seed sweep compiles nothing new;
    jax would not retrace for another PRNG kind whose keys have the same shape)."""

    def next_epoch(epoch: Any, key: Any) -> tuple[Any, Any, Any]:
        return layout.batches(epoch, key), epoch + 1, jnp.zeros((), jnp.int32)

    return jax.jit(next_epoch)


@functools.lru_cache(maxsize=64)
def first_batch(short: int | None, replicated: Any) -> Callable[[Any, Any], Any]:
    """`(data, order) -> batch`: an epoch's first batch of a resident dataset, by its
    order; `short` rows where the only batch is short, `replicated` its sharding over a
    mesh (None on one device)."""

    def first(data: Any, order: Any) -> Any:
        rows = order[0] if short is None else order[0, :short]
        if replicated is None:
            return jax.tree.map(lambda leaf: leaf[rows], data)
        return jax.tree.map(lambda leaf: take_rows(leaf, rows), data)

    placed = {} if replicated is None else {"out_shardings": replicated}
    return jax.jit(first, **placed)


@functools.cache
def pack() -> Callable[[Any], Any]:
    """A tree as one flat device buffer per dtype (`packing.pack_leaves`)."""
    return jax.jit(pack_leaves)


@functools.lru_cache(maxsize=256)
def unpack(treedef: Any, spec: tuple[tuple[Any, Any, bool], ...]) -> Callable[[Any], Any]:
    """The tree of `treedef` with leaves of `spec`, `((shape, dtype, weak_type), ...)`,
    from its pack."""
    return jax.jit(unpacker(treedef, spec))


@functools.lru_cache(maxsize=64)
def fresh_tail(names: tuple[str, ...], guard: bool, members: int | None) -> Callable[[], Any]:
    """Zeroed accumulators of the metrics `names` (and the guard's flag); a population's
    for `members` members. An accumulator's form depends on its name alone
    (`MetricSpec.init`)."""
    metrics = tuple(MetricSpec(name, None) for name in names)
    if members is None:
        return jax.jit(lambda: init_tail(metrics, guard))
    return jax.jit(lambda: population_tail(metrics, guard, members))
