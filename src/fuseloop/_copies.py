"""Device copies of a tree's arrays in one cached program (`private_copy`), and a call
that gathers arrays committed to different device sets first (`gathering_call`).

Copying leaf by leaf eagerly (`jax.tree.map(jnp.copy, tree)`) compiles one small program
per leaf shape and dispatches one per leaf; a kept best step state (early stopping's
`restore_best`, a population's members) or the `fuse="auto"` probe's private carry is
copied here instead, one dispatch for the whole tree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._placement import on_one_device_set

__all__ = ["gathering_call", "private_copy"]


@jax.jit
def _copy_arrays(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


def private_copy(tree: Any) -> Any:
    """A device copy of every array leaf (other leaves are kept as they are), made by one
    cached program; launched asynchronously like any other.

    Example:
        >>> kept = private_copy({"w": jnp.ones(3), "note": "kept as is"})
        >>> kept["note"], kept["w"].tolist()
        ('kept as is', [1.0, 1.0, 1.0])
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    to_copy = [leaves[i] for i in arrays]
    if not all(isinstance(leaf, jax.Array) for leaf in to_copy):
        # Explicit transfer of host arrays (an initial state: not counted as data transfer).
        to_copy = jax.device_put(to_copy)
    copied = gathering_call(_copy_arrays, to_copy)
    for i, leaf in zip(arrays, copied, strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def gathering_call(program: Any, tree: Any, *args: Any) -> Any:
    """`program(tree, *args)`, or where jit refuses `tree` because its arrays are committed
    to different sets of devices, the same call with them on one (`on_one_device_set`)."""
    try:
        return program(tree, *args)
    except ValueError as error:
        gathered = on_one_device_set(tree) if "incompatible devices" in str(error) else tree
        if gathered is tree:
            raise
        return program(gathered, *args)
