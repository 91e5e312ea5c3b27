"""Data fuseloop cannot slice by example or stack into a chunk, refused where it is given
with the form that works: scipy and jax sparse matrices (their arrays hold non-zeros, not
examples), typed PRNG keys (numpy holds no such dtype), masked arrays with entries masked
(read as arrays, they lose the mask) and objects numpy cannot read as arrays."""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from ._prng_keys import holds_typed_keys

__all__ = [
    "masked_fix",
    "refuse_jax_sparse",
    "refuse_unsliceable",
    "refuse_unstackable",
    "typed_keys_fix",
    "unmasked",
]


def refuse_jax_sparse(part: Any, name: str) -> None:
    """Refuses a `jax.experimental.sparse` array (BCOO, BCSR) in data that fuseloop slices
    by example: its leaves are its stored values and their indices, so slicing them would
    take batches of non-zeros, not of examples."""
    sparse = sys.modules.get("jax.experimental.sparse")  # loaded wherever such a leaf exists
    if sparse is None:
        return
    found = jax.tree_util.tree_flatten_with_path(
        part, is_leaf=lambda node: isinstance(node, sparse.JAXSparse)
    )[0]
    for path, leaf in found:
        if isinstance(leaf, sparse.JAXSparse):
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} is a jax.experimental.sparse "
                f"{type(leaf).__name__} of shape {leaf.shape}, whose arrays hold its "
                f"non-zeros, not its examples: pass it dense (.todense()), or densify it "
                f"batch by batch in a generator of (x[i:i + b].todense(), y[i:i + b])"
            )


def typed_keys_fix(name: str, dtype: Any) -> str:
    """Why a leaf of typed PRNG keys (`jax.random.key`) cannot be data, and the fix."""
    return (
        f"{name} holds typed PRNG keys ({dtype}), which fuseloop cannot check, stack or "
        f"slice as data (numpy holds no such dtype): pass their raw data, "
        f"jax.random.key_data(keys), and rebuild the keys in the step with "
        f"jax.random.wrap_key_data(data)"
    )


def masked_fix(name: str, leaf: Any) -> str | None:
    """Why a numpy masked array (what netCDF and HDF readers return for data with a fill
    value) cannot be data, and the fix; None for any other leaf. Read as an array it
    loses its mask: the fill values would be trained on, as jax refuses to do."""
    if not isinstance(leaf, np.ma.MaskedArray) or not np.ma.is_masked(leaf):
        return None  # (nothing masked: its values are all there is)
    code = name if " " not in name else "x"  # how the fix reads for a leaf with no name
    return (
        f"{name} is a numpy masked array ({np.ma.count_masked(leaf)} masked entries), whose "
        f"mask fuseloop, like jax, does not read: its masked entries' values would be used. "
        f"Pass {code}.filled(value) (and the mask, ~{code}.mask, as an input or as weights "
        f"where the model or loss should skip those entries)"
    )


def unmasked(leaf: Any, name: str) -> Any:
    """`leaf`, refused where it is a masked array with entries masked (`masked_fix`)."""
    masked = masked_fix(name, leaf) if type(leaf) is not np.ndarray else None
    if masked is not None:
        raise ValueError(masked)
    return leaf


def refuse_unstackable(leaf: Any, name: str) -> None:
    """Refuses a scipy sparse matrix (what sklearn's one-hot and tf-idf encoders return),
    which numpy reads as one object with no examples axis, naming the dense form; an array
    of typed PRNG keys (`typed_keys_fix`); a masked array (`masked_fix`); and an object
    with a shape that numpy cannot read as an array (`_unreadable`)."""
    if holds_typed_keys(leaf):
        raise ValueError(typed_keys_fix(name, leaf.dtype))
    unmasked(leaf, name)
    if _unreadable(leaf):
        fix = f"np.asarray({name}.values)" if hasattr(leaf, "values") else "its values"
        raise ValueError(
            f"{name} is a {type(leaf).__name__} of shape {leaf.shape} without __array__, so "
            f"numpy cannot read it as an array: pass {fix}"
        )
    if _sparse(leaf):
        raise ValueError(
            f"{name} is a scipy sparse matrix ({type(leaf).__name__} of shape "
            f"{getattr(leaf, 'shape', '?')}); fuseloop trains on dense arrays: convert it "
            f"with .toarray() (one too large to densify whole can be densified batch by "
            f"batch, by a generator of (x[i:i + b].toarray(), y[i:i + b]) batches over "
            f"x = x.tocsr())"
        )


def refuse_unsliceable(part: Any, name: str) -> None:
    """`refuse_jax_sparse` of `part`, then `refuse_unstackable` of each of its leaves, all
    named `name` (the inputs `fl.predict` is given or reads from a source)."""
    refuse_jax_sparse(part, name)
    for leaf in jax.tree.leaves(part):
        refuse_unstackable(leaf, name)


def _sparse(leaf: Any) -> bool:
    """Whether `leaf` is a scipy sparse matrix (scipy loaded already wherever one exists)."""
    sparse = sys.modules.get("scipy.sparse")
    return sparse is not None and bool(sparse.issparse(leaf))


def _unreadable(leaf: Any) -> bool:
    """An object with a shape that numpy would hold as one object (no array protocol, no
    buffer): an xarray-like wrapper whose array is its `.values`."""
    if not hasattr(leaf, "shape") or isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
        return False
    protocols = ("__array__", "__array_interface__", "__array_struct__")
    if any(hasattr(leaf, name) for name in protocols) or _sparse(leaf):
        return False
    try:  # the buffer protocol (a memoryview, a Cython typed memoryview)
        memoryview(leaf)
    except TypeError:
        return True
    return False
