"""Typed PRNG keys (`jax.random.key`): told apart by their dtype, and read as their raw
uint32 data (`jax.random.key_data`) wherever numpy must hold them or jax moves only that."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["holds_typed_keys", "is_typed_keys", "raw_keys"]


def is_typed_keys(dtype: Any) -> bool:
    """Whether `dtype` is a typed PRNG key's (numpy has no such dtype).

    Example:
        >>> is_typed_keys(jax.random.key(0).dtype), is_typed_keys(jax.numpy.uint32)
        (True, False)
    """
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def holds_typed_keys(leaf: Any) -> bool:
    """Whether `leaf` is a jax array of typed PRNG keys."""
    return isinstance(leaf, jax.Array) and is_typed_keys(leaf.dtype)


def raw_keys(leaf: Any) -> Any:
    """`leaf`, typed PRNG keys as their raw data (an nnx stream's, say); other leaves as
    they are.

    Example:
        >>> raw_keys(jax.random.key(0)).dtype
        dtype('uint32')
    """
    return jax.random.key_data(leaf) if holds_typed_keys(leaf) else leaf
