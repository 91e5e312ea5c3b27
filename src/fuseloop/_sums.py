"""Sums and counts: what a metric accumulator adds, in one fixed order (docs/design.md §2)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Mean",
    "accumulate",
    "accumulator_dtype",
    "accumulated",
    "compensated_add",
    "empty_accumulator",
    "mean_of",
    "pairwise_sum",
    "refuse_unsummable",
]

Array = Any


class Mean(NamedTuple):
    """A batch's contribution to a mean over examples: the sum of its per-example values
    and how many examples it holds. Accumulating these (sums and counts, no division
    until the host reads them) weighs a ragged last batch by its size."""

    total: Array  # scalar of `accumulator_dtype()`: sum over the batch's examples (elements)
    count: Array  # scalar of `accumulator_dtype()`: number of examples (elements) summed


def accumulator_dtype() -> np.dtype[Any]:
    """The dtype metrics are summed, counted and read in: float32, or float64 while JAX's
    64-bit mode (`jax_enable_x64`) is on. A float64 model's loss read through float32
    would keep 7 digits and read `inf` beyond 3.4e38 or 0 below 1e-38 (docs/design.md §2).

    Example:
        >>> accumulator_dtype()  # 64-bit mode is off by default
        dtype('float32')
    """
    return np.dtype(np.float64 if jax.config.read("jax_enable_x64") else np.float32)


def refuse_unsummable(value: Any, what: str) -> None:
    """A TypeError where `value`, what a metric returned for a batch, is not an array (or
    a `Mean`, or a number), or holds complex numbers: its sum would keep the real part
    alone, the accumulators being real."""
    if not isinstance(value, (Mean, jax.Array, np.ndarray, np.generic, int, float)):
        raise TypeError(
            f"{what} returned a {type(value).__name__}, not an array: a metric returns "
            f"per-example values (the batch first) or one scalar per batch. Give each value "
            f"its own metric, e.g. loop.metric(fn_a, name='a').metric(fn_b, name='b')"
        )
    if any(jnp.iscomplexobj(part) for part in jax.tree.leaves(value)):
        raise TypeError(
            f"{what} returned complex values, and a metric is a mean of real numbers (the "
            f"imaginary part would be dropped): return a real one, e.g. jnp.abs(d) or "
            f"jnp.abs(d) ** 2 of a complex difference d, or jnp.real and jnp.imag of it as "
            f"two metrics"
        )


def mean_of(values: Array) -> Mean:
    dtype = accumulator_dtype()
    values = jnp.asarray(values, dtype)
    return Mean(pairwise_sum(values), jnp.asarray(values.size, dtype))


def pairwise_sum(values: Array) -> Array:
    """The sum of every element (in `accumulator_dtype()`), added in one fixed order:
    pairs, then pairs of pairs (the array padded with zeros to a power of two).

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
    dtype = accumulator_dtype()
    flat = jnp.ravel(jnp.asarray(values, dtype))
    if flat.size == 0:
        return jnp.zeros((), dtype)
    width = 1 << (flat.size - 1).bit_length()
    flat = jnp.pad(flat, (0, width - flat.size))
    while flat.size > 1:
        pairs = flat.reshape(-1, 2)
        flat = pairs[:, 0] + pairs[:, 1]
    return flat[0]


def compensated_add(total: Array, error: Array, value: Array) -> tuple[Array, Array]:
    """`total + value` in `total`'s dtype, Kahan's compensated way: `error` holds what the additions
    so far rounded away, and is added to the next value first. The running sum is
    `total + error`.

    An epoch's metric sums a value per step into one float32: once the sum is large, each
    addition rounds, and over a plateau (similar values) all the same way, so a plain
    running sum drifted by 4e-4 of its value over 100,000 steps and by 1% over a million.
    Compensated, it stays within a rounding of the exact sum (2e-8 of it over a million
    steps). A non-finite sum keeps no error (it would turn inf into NaN).

    Example:
        >>> import numpy as np
        >>> total, error = np.float32(2.0**24), np.float32(0.0)
        >>> for _ in range(4):
        ...     total, error = compensated_add(total, error, np.float32(1.0))
        >>> float(total + error) - 2.0**24
        4.0
    """
    corrected = jnp.asarray(value, jnp.result_type(total)) + error
    added = total + corrected
    lost = corrected - (added - total)  # what `added` rounded away
    return added, jnp.where(jnp.isfinite(added), lost, jnp.zeros_like(lost))


# A metric's accumulator: compensated sums of its values and counts, each an error term
# beside it (`compensated_add`), all scalars of `accumulator_dtype()`.
_ACCUMULATOR = ("sum", "count", "sum_error", "count_error")


def empty_accumulator() -> dict[str, Array]:
    dtype = accumulator_dtype()
    return {key: jnp.zeros((), dtype) for key in _ACCUMULATOR}


def accumulate(acc: dict[str, Array], total: Array, count: Array) -> dict[str, Array]:
    """`acc` with a batch's sum `total` and `count` added."""
    added, added_error = compensated_add(acc["sum"], acc["sum_error"], total)
    counted, count_error = compensated_add(acc["count"], acc["count_error"], count)
    return {"sum": added, "count": counted, "sum_error": added_error, "count_error": count_error}


def accumulated(acc: dict[str, Any]) -> tuple[Any, Any]:
    """The sum and count an accumulator holds, on the device or (read to numpy) on the
    host: the same two additions, in the accumulator's dtype, either way."""
    return acc["sum"] + acc["sum_error"], acc["count"] + acc["count_error"]
