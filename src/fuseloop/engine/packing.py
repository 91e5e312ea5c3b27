"""A tree's leaves as one flat buffer per dtype: packed inside a program, unpacked on the
device or on the host.

On a CPU every array a program takes or returns, and every array the host reads, costs
about a microsecond or more of its own; a carry of ~20 small arrays packed into a buffer
per dtype costs a few (docs/design.md §6).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._json_tree import as_weak
from .._placement import tree_bytes

__all__ = ["copying", "pack_leaves", "segment_of", "unpack_on_host", "unpacker"]


def copying(fn: Callable[..., Any], limit: int) -> Callable[..., Any]:
    """`fn`, also returning (last) a packed copy of the carry it ends with when that carry
    holds at most `limit` bytes, else None (decided from shapes, at trace time)."""

    def program(state: Any, tail: Any, *args: Any) -> tuple[Any, ...]:
        out = fn(state, tail, *args)
        carry = (out[0], out[1])
        return (*out, pack_leaves(carry) if tree_bytes(carry) <= limit else None)

    program.__name__ = getattr(fn, "__name__", "program")
    return program


def unpack_on_host(packed: tuple[list[Any], list[Any]], like: Any) -> Any:
    """The host arrays of `pack_leaves(tree)` read to the host (`packed`), as the tree
    `like` (arrays or shape-dtype structs shaped as `tree`) holds them; numpy views, no copy.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> tree = {"a": jnp.arange(3.0), "b": jnp.int32(7), "c": jnp.ones((2, 2))}
        >>> host = unpack_on_host(jax.device_get(jax.jit(pack_leaves)(tree)), tree)
        >>> host["a"].tolist(), int(host["b"]), host["c"].shape
        ([0.0, 1.0, 2.0], 7, (2, 2))
    """
    buffers, whole = packed
    leaves, treedef = jax.tree.flatten(like)
    order = list(dict.fromkeys(leaf.dtype for leaf in leaves if _packable(leaf.dtype)))
    offsets = dict.fromkeys(order, 0)
    whole_iter = iter(whole)
    out = []
    for leaf in leaves:
        if not _packable(leaf.dtype):
            out.append(next(whole_iter))
            continue
        start, size = offsets[leaf.dtype], math.prod(leaf.shape)
        flat = buffers[order.index(leaf.dtype)]
        out.append(flat[start : start + size].reshape(leaf.shape))
        offsets[leaf.dtype] = start + size
    return jax.tree.unflatten(treedef, out)


def _packable(dtype: Any) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)  # typed PRNG keys stay whole


def pack_leaves(carry: Any) -> tuple[list[Any], list[Any]]:
    """`carry`'s leaves packed into `(one flat buffer per dtype in first-seen order, the
    leaves that cannot be packed, copied)` (inside a program): the host then reads a few
    buffers instead of many small arrays (each read costs about as much as a small one's
    copy), and a copy of the carry is one output per dtype. `unpack_on_host` and
    `unpacker` undo it.
    """
    groups: dict[Any, list[Any]] = {}
    whole = []
    for leaf in jax.tree.leaves(carry):
        if _packable(leaf.dtype):
            groups.setdefault(leaf.dtype, []).append(jnp.ravel(leaf))
        else:
            whole.append(jnp.copy(leaf))
    return [jnp.concatenate(parts) for parts in groups.values()], whole


def unpacker(treedef: Any, spec: tuple[tuple[Any, Any, bool], ...]) -> Callable[..., Any]:
    """The inverse of `pack_leaves` (inside a program) for carries with this structure
    (`treedef`) and these leaves' `(shape, dtype, weak_type)`: a weakly typed leaf (a loss
    scale given as a Python float) comes back weakly typed, as the step keeps it, or the
    steps after a rollback would promote otherwise than the plain loop's."""

    def unpack(packed: tuple[list[Any], list[Any]]) -> Any:
        buffers, whole = packed
        order = list(dict.fromkeys(d for _, d, _ in spec if _packable(d)))
        offsets = dict.fromkeys(order, 0)
        whole_iter = iter(whole)
        leaves = []
        for shape, dtype, weak in spec:
            if not _packable(dtype):
                leaves.append(next(whole_iter))
                continue
            size = math.prod(shape)
            start = offsets[dtype]
            flat = buffers[order.index(dtype)]
            leaf = jax.lax.slice(flat, (start,), (start + size,)).reshape(shape)
            leaves.append(as_weak(leaf) if weak else leaf)
            offsets[dtype] = start + size
        return jax.tree.unflatten(treedef, leaves)

    return unpack


def segment_of(tree: Any, s: int) -> Any:
    """Segment `s` of a host-side per-segment buffer of a whole-run dispatch (arrays with
    the segment first, dicts of them, a population's packed accumulators).

    Example:
        >>> import numpy as np
        >>> segment_of({"loss": np.array([1.0, 2.0])}, 1)
        {'loss': np.float64(2.0)}
    """
    if isinstance(tree, tuple) and not tree:
        return tree
    if isinstance(tree, dict):
        return {k: segment_of(v, s) for k, v in tree.items()}
    if hasattr(tree, "buffers"):  # a population's packed accumulators (population_acc.py)
        return jax.tree.map(lambda a: a[s], tree)
    return tree[s]
