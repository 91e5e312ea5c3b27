"""A model that read a batch's x as one example: a plain `nn.Dense` on x of shape (B,), a
recurrent layer on x of shape (B, T) without a feature axis. Its output has no axis of the
batch's examples; a built-in loss fails on it, and a custom loss may broadcast it over y."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import Var

__all__ = ["refuse_broadcast_over_examples", "unbatched_output"]


def unbatched_output(first_x: Any, y_pred: Any) -> ValueError | None:
    """The error for a model that read a batch's x as one example (a plain `nn.Dense` on
    x of shape (B,), a recurrent layer on x of shape (B, T) without a feature axis): its
    output has no leading axis of the batch's examples, and a loss failing on it would
    otherwise blame y. None where that is not what happened. Asked only once the loss
    has failed: a loss may take an unbatched output on purpose."""
    leaves = jax.tree.leaves(first_x[1]) if first_x is not None else []
    out = getattr(y_pred, "shape", None)
    if len(leaves) != 1 or len(np.shape(leaves[0])) < 1 or out is None:
        return None
    shape = np.shape(leaves[0])
    rows = shape[0]
    if len(out) >= 1 and out[0] == rows:
        return None
    if len(shape) == 1:
        return ValueError(
            f"data: x has shape ({rows},), one axis, which the model reads as one example's "
            f"{rows} features: its output of shape {tuple(out)} has no axis of the batch's "
            f"{rows} examples. For one feature per example, give x a feature axis: x[:, None] "
            f"(or x.reshape(-1, 1); fl.models.mlp adds it itself)"
        )
    if not rows or not hasattr(first_x[1], "shape"):
        return None  # no rows to tell by; a leaf of a tree of x, which x[..., None] is not
    if any(size and size % rows == 0 for size in out):
        return None  # an axis of the examples, moved or merged (tokens of (B*T, C)): y's
    return ValueError(
        f"data: x has shape {tuple(shape)}, but the model's output of shape {tuple(out)} "
        f"has no leading axis of the batch's {rows} examples: the model read the batch as "
        f"one example. A recurrent layer (flax's nn.RNN, a scan over time) does so with x "
        f"of shape (batch, time) and no feature axis: give x one, x[..., None]; otherwise "
        f"keep the batch's axis first in the model's output"
    )


def refuse_broadcast_over_examples(
    first_x: Any, ys: Any, y_pred: Any, name: str, loss_fn: Callable[[Any, Any], Any]
) -> None:
    """Refuses a custom loss that reads y against an output with an axis but none of the
    batch's examples, x having one axis: a model that read the batch as one example's
    features (a plain `nn.Dense` on x of shape (B,) returns shape (1,)) and a loss that
    broadcast that one prediction over every example's target train a wrong model in
    silence. A built-in loss's own checks refuse it. Left alone: a scalar output (a model
    that returns its batch's loss, or a constant baseline) and a loss that never reads y."""
    leaves = jax.tree.leaves(first_x[1]) if first_x is not None else []
    if len(leaves) != 1 or len(np.shape(leaves[0])) != 1 or not np.ndim(y_pred):
        return
    rows = np.shape(leaves[0])[0]
    if rows < 2 or tuple(getattr(ys, "shape", ()))[:1] != (rows,):
        return
    unbatched = unbatched_output(first_x, y_pred)
    if unbatched is not None and _reads_y(loss_fn, ys, y_pred):
        raise ValueError(
            f"{unbatched}. The loss {name!r} took that output against y of shape "
            f"{tuple(ys.shape)}: one prediction for all {rows} examples' targets"
        )


def _reads_y(loss_fn: Callable[[Any, Any], Any], ys: Any, y_pred: Any) -> bool:
    """Whether the loss's value depends on y at all (traced once, abstractly: a loss that
    returns the model's own batch loss ignores y)."""
    closed = jax.make_jaxpr(loss_fn)(ys, y_pred)
    y_vars = set(closed.jaxpr.invars[: len(jax.tree.leaves(ys))])
    read = [v for eqn in closed.jaxpr.eqns for v in eqn.invars] + list(closed.jaxpr.outvars)
    return any(isinstance(v, Var) and v in y_vars for v in read)
