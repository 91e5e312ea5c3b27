"""A model that read a batch's x as one example: a plain `nn.Dense` on x of shape (B,), a
recurrent layer on x of shape (B, T) without a feature axis. Its output has no axis of the
batch's examples; a built-in loss fails on it, and a custom loss may broadcast it over y."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._data_flow import output_reads_inputs
from ._metrics import resolve_loss

__all__ = ["refuse_broadcast_over_examples", "unbatched_output"]


def unbatched_output(first_x: Any, y_pred: Any) -> ValueError | None:
    """The error for a model that read a batch's x as one example (a plain `nn.Dense` on
    x of shape (B,), a recurrent layer on x of shape (B, T) without a feature axis): its
    output has no leading axis of the batch's examples, and a loss failing on it would
    otherwise blame y. None where that is not what happened. Asked once a loss has failed
    on the output; a custom loss that took it is asked by `refuse_broadcast_over_examples`."""
    leaves = jax.tree.leaves(first_x[1]) if first_x is not None else []
    out = getattr(y_pred, "shape", None)
    if len(leaves) != 1 or len(np.shape(leaves[0])) < 1 or out is None:
        return None
    shape = np.shape(leaves[0])
    rows = shape[0]
    if len(out) >= 1 and out[0] == rows:
        return None
    if len(shape) == 1:
        return ValueError(_one_axis(first_x, rows, tuple(out), ""))
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


def _one_axis(first_x: Any, rows: int, out: tuple[int, ...], taken: str) -> str:
    """The message for x of one axis read as one example's features (`taken`: what a
    custom loss did with the output, or empty), naming x's one leaf where x is a tree."""
    (path, _), *_ = jax.tree_util.tree_flatten_with_path(first_x[1])[0]
    x = f"x{jax.tree_util.keystr(path)}"
    return (
        f"data: {x} has shape ({rows},), one axis, which the model reads as one example's "
        f"{rows} features: its output of shape {out} has no axis of the batch's {rows} "
        f"examples{taken}. For one feature per example, give x a feature axis: {x}[:, None] "
        f"(or .reshape(-1, 1); fl.models.mlp adds it itself)"
    )


def refuse_broadcast_over_examples(
    first_x: Any, ys: Any, y_pred: Any, loss: Any, x_flow: Callable[[], Any]
) -> None:
    """Refuses a custom `loss` that compared one output, with an axis but none of the
    batch's examples, with every example's target, where x has one axis: a plain
    `nn.Dense(1)` on x of shape (B,) reads the batch as one example's features and returns
    shape (1,), which `mean((y - y_pred) ** 2)` broadcasts over y: a wrong model, trained in
    silence. A built-in loss's own checks refuse it. Left alone: an output of one array
    with an axis of the examples (moved or merged, as in (members, B) or (B * K,)), a
    scalar output (a model that returns its batch's own loss), a loss that does not read y
    (it sums the model's loss terms), and a model whose output does not read x (a constant
    baseline, a distribution's parameters fitted to y): `x_flow()` is the model's traced
    call, x its first input, traced only when every other sign holds."""
    xs, y_leaves, outs = (jax.tree.leaves(tree) for tree in (first_x[1], ys, y_pred))
    if len(xs) != 1 or len(y_leaves) != 1 or len(outs) != 1 or np.ndim(xs[0]) != 1:
        return
    rows, out = np.shape(xs[0])[0], tuple(np.shape(outs[0]))
    if rows < 2 or np.shape(y_leaves[0])[:1] != (rows,) or not out:
        return
    if any(size % rows == 0 for size in out):
        return  # an axis of the examples, moved or merged
    name, loss_fn = resolve_loss(loss)
    if not output_reads_inputs(jax.make_jaxpr(loss_fn)(ys, y_pred), 1):
        return  # the model's own loss terms
    if not output_reads_inputs(x_flow(), 1):
        return  # no reading of x: the output is meant to be one for the batch
    taken = (
        f", and the loss {name!r} took that same output against each of their targets "
        f"(y of shape {np.shape(y_leaves[0])})"
    )
    raise ValueError(_one_axis(first_x, rows, out, taken))
