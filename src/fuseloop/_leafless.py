"""A chunk of batches that hold no arrays (`None`, `()`, `{}`: a step that simulates its own
data, an environment's rollout), which stacking cannot give a leading axis: the chunk keeps
its slot count as static data instead, so the device loop knows its length and each slot
hands the step the batch's own structure."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["Leafless", "chunk_size", "repeated", "slot_of", "widened"]


@jax.tree_util.register_pytree_node_class
class Leafless:
    """`size` slots of a batch whose structure `treedef` holds no leaves. A pytree with no
    children: its size and structure are part of a program's signature, so a program is
    compiled per chunk size, as for a chunk of arrays.

    Example:
        >>> import jax
        >>> chunk = Leafless(3, jax.tree.structure(None))
        >>> jax.tree.leaves(chunk), chunk_size(chunk), slot_of(chunk, 0)
        ([], 3, None)
    """

    def __init__(self, size: int, treedef: Any):
        self.size = size
        self.treedef = treedef

    def tree_flatten(self) -> tuple[tuple[()], tuple[int, Any]]:
        return (), (self.size, self.treedef)

    @classmethod
    def tree_unflatten(cls, aux: tuple[int, Any], children: Any) -> Leafless:
        return cls(*aux)


def chunk_size(chunk: Any) -> int:
    """A stacked chunk's slot count: its leaves' leading axis, or a leafless chunk's own."""
    if isinstance(chunk, Leafless):
        return chunk.size
    return int(jax.tree.leaves(chunk)[0].shape[0])


def slot_of(chunk: Any, i: Any) -> Any:
    """The batch in slot `i` of a stacked chunk, a leafless one's included (`i` may be
    traced)."""
    if isinstance(chunk, Leafless):
        return jax.tree.unflatten(chunk.treedef, [])
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), chunk)


def widened(batch: Any, slots: int) -> Any:
    """One batch as a chunk of `slots` slots, each the batch (a broadcast, no copy)."""
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves:
        return Leafless(slots, treedef)
    return jax.tree.map(lambda a: jax.numpy.broadcast_to(a[None], (slots, *a.shape)), batch)


def repeated(batch: Any, copies: int) -> Any:
    """A host chunk of `copies` copies of `batch` (a probe's chunk: each slot the batch)."""
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves:
        return Leafless(copies, treedef)
    return jax.tree.map(lambda a: np.repeat(np.asarray(a)[None], copies, axis=0), batch)
