"""Sums and counts: what a metric accumulator adds, in one fixed order (docs/design.md §2)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

__all__ = ["Mean", "mean_of", "pairwise_sum"]

Array = Any


class Mean(NamedTuple):
    """A batch's contribution to a mean over examples: the sum of its per-example values
    and how many examples it holds. Accumulating these (sums and counts, no division
    until the host reads them) weighs a ragged last batch by its size."""

    total: Array  # float32 scalar: sum over the batch's examples (elements)
    count: Array  # float32 scalar: number of examples (elements) summed


def mean_of(values: Array) -> Mean:
    values = jnp.asarray(values, jnp.float32)
    return Mean(pairwise_sum(values), jnp.asarray(values.size, jnp.float32))


def pairwise_sum(values: Array) -> Array:
    """The float32 sum of every element, added in one fixed order: pairs, then pairs of
    pairs (the array padded with zeros to a power of two).

    XLA:CPU chooses how a `jnp.sum` is reduced by the program around it: a sequential loop
    in one program, vector lanes in another, and the last bits follow. A metric's sum is
    computed in the fused and unfused chunk programs, in a whole-run dispatch and in the
    evaluator's program; written as elementwise adds, which XLA does not reorder, it is the
    same number in all of them (docs/design.md §2).

    Example:
        >>> import numpy as np
        >>> float(pairwise_sum(np.arange(5, dtype=np.float32)))
        10.0
    """
    flat = jnp.ravel(jnp.asarray(values, jnp.float32))
    if flat.size == 0:
        return jnp.zeros((), jnp.float32)
    width = 1 << (flat.size - 1).bit_length()
    flat = jnp.pad(flat, (0, width - flat.size))
    while flat.size > 1:
        pairs = flat.reshape(-1, 2)
        flat = pairs[:, 0] + pairs[:, 1]
    return flat[0]
