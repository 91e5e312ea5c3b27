"""The model's outputs at another batch size, for the cross-broadcast check of a loss or
metric (`_target_shapes.py`): the step that calls them knows the model and the batch's x,
the check does not. It traces a function again at a batch size unlike any other axis to
tell a true cross from a coincidence of sizes; resizing every output whose first axis is
the batch's size would take a (K, D) output (k-means centroids, a mixture's means) whose K
happens to equal the batch size for one that follows the batch (docs/design.md §5)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["model_outputs_there", "model_outputs_at", "outputs_at"]

# `(batch, other) -> abstract outputs or None`, set while a step calls a loss or metric.
_OUTPUTS_AT: contextvars.ContextVar[Callable[[int, int], Any] | None] = contextvars.ContextVar(
    "fuseloop_outputs_at", default=None
)


@contextlib.contextmanager
def model_outputs_at(at: Callable[[int, int], Any] | None) -> Iterator[None]:
    """Makes `at` (from `outputs_at`) the outputs' source while the block runs."""
    token = _OUTPUTS_AT.set(at)
    try:
        yield
    finally:
        _OUTPUTS_AT.reset(token)


def outputs_at(model: Any, variables: Any, x: Any) -> Callable[[int, int], Any]:
    """`(batch, other) -> ` the model's abstract outputs (evaluation mode: shapes are the
    same in training) on `x` with `other` rows where it has `batch`; None where a leaf of
    x has not `batch` rows or the model fails at the other size (one that fixes it)."""

    def at(batch: int, other: int) -> Any:
        leaves = jax.tree.leaves(x)
        if not leaves or any(np.shape(leaf)[:1] != (batch,) for leaf in leaves):
            return None
        resized = jax.tree.map(lambda a: jax.ShapeDtypeStruct((other, *a.shape[1:]), a.dtype), x)
        try:
            return jax.eval_shape(
                lambda v, xs: model.forward(v, xs, train=False, rng=None)[0], variables, resized
            )
        except Exception:  # noqa: BLE001 - the check falls back to resizing the outputs
            return None

    return at


def model_outputs_there(batch: int, other: int, y_pred: Any) -> Any:
    """The model's abstract outputs at `other` rows for `batch`, where the step calling
    the check gave their source and they are shaped as `y_pred` is (None otherwise)."""
    at = _OUTPUTS_AT.get()
    made = at(batch, other) if at is not None else None
    shaped: object = jax.tree.structure(y_pred)  # no stub for PyTreeDef: compare as objects
    if made is None or shaped != jax.tree.structure(made):
        return None
    return made
