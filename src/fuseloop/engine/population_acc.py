"""A population's metric accumulators, packed into one buffer per dtype (docs/design.md §8).

Each metric keeps a few float32 (float64 under x64) scalars per member (a sum and a
count, each with its compensation: `_sums.accumulate`). Kept apart, every one of them is
its own small array: on XLA's CPU backend each accumulator update and each
records write is then a separate kernel per step, which costs more than the vmapped step
of a tiny model. Packed, a member's accumulators are one vector per dtype, updated by one
fused kernel and written into the records by one in-place update per step.

`PackedAcc` is a pytree (its leaves are the buffers) and a read-only mapping that looks
like the unpacked accumulators (`acc[name][key]`), so the host code that reads metrics
(`HostReads`, `member_metrics`) reads it unchanged. Packing only moves values: the sums
are the same additions, so a packed run is bitwise the unpacked one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PackedAcc", "pack", "packed_like"]


@dataclass(frozen=True)
class Layout:
    """Where each accumulator leaf lives: its buffer (by dtype), offset and shape."""

    treedef: Any  # of the unpacked accumulators ({name: {key: leaf}})
    dtypes: tuple[str, ...]  # one buffer per dtype, in this order
    leaves: tuple[tuple[int, int, tuple[int, ...]], ...]  # (buffer, offset, shape)


class PackedAcc(Mapping[str, Any]):
    """Accumulators packed into `buffers` (one per dtype; any leading axes, e.g. the
    member axis or a chunk's slots, come before the packed one)."""

    def __init__(self, buffers: tuple[Any, ...], layout: Layout):
        self.buffers, self.layout = tuple(buffers), layout

    def unpack(self) -> Any:
        """The accumulators as the metrics keep them (`{name: {key: array}}`)."""
        leaves = []
        for buffer, offset, shape in self.layout.leaves:
            flat = self.buffers[buffer]
            size = int(np.prod(shape, dtype=np.int64))
            leaves.append(flat[..., offset : offset + size].reshape(flat.shape[:-1] + shape))
        return jax.tree.unflatten(self.layout.treedef, leaves)

    def __getitem__(self, name: str) -> Any:
        return self.unpack()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(jax.tree.unflatten(self.layout.treedef, [0] * len(self.layout.leaves)))

    def __len__(self) -> int:
        return sum(1 for _ in self)


jax.tree_util.register_pytree_node(
    PackedAcc,
    lambda acc: (acc.buffers, acc.layout),
    lambda layout, buffers: PackedAcc(tuple(buffers), layout),
)


def _layout(acc: Any) -> Layout:
    leaves, treedef = jax.tree.flatten(acc)
    dtypes: list[str] = []
    sizes: dict[str, int] = {}
    placed = []
    for leaf in leaves:
        dtype = jnp.result_type(leaf).name
        if dtype not in sizes:
            dtypes.append(dtype)
            sizes[dtype] = 0
        shape = tuple(np.shape(leaf))
        placed.append((dtypes.index(dtype), sizes[dtype], shape))
        sizes[dtype] += int(np.prod(shape, dtype=np.int64))
    return Layout(treedef, tuple(dtypes), tuple(placed))


def pack(acc: Any, layout: Layout | None = None) -> PackedAcc:
    """One member's accumulators (no leading axes) packed by `layout` (or a new one)."""
    layout = layout or _layout(acc)
    parts: list[list[Any]] = [[] for _ in layout.dtypes]
    for leaf, (buffer, _, _) in zip(jax.tree.leaves(acc), layout.leaves, strict=True):
        parts[buffer].append(jnp.ravel(leaf))
    buffers = tuple(
        jnp.concatenate(chunks) if chunks else jnp.zeros((0,), dtype)
        for chunks, dtype in zip(parts, layout.dtypes, strict=True)
    )
    return PackedAcc(buffers, layout)


def packed_like(acc: Any, packed: Any) -> Any:
    """`acc` packed as `packed` is (unchanged when `packed` is not a `PackedAcc`)."""
    return pack(acc, packed.layout) if isinstance(packed, PackedAcc) else acc
