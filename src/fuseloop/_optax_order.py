"""An optax loss passed as a fuseloop loss or metric as it is: its arguments are the other
way round (`optax.<loss>(predictions, targets)` against fuseloop's `fn(y_true, y_pred)`)."""

from __future__ import annotations

import functools
from typing import Any

import optax

__all__ = ["refuse_optax_order"]

# The optax losses a built-in loss computes as it is (their mean over the examples).
_BUILT_IN = {
    "softmax_cross_entropy_with_integer_labels": "sparse_categorical_cross_entropy",
    "softmax_cross_entropy": "categorical_cross_entropy",
    "sigmoid_binary_cross_entropy": "binary_cross_entropy",
    "squared_error": "mean_squared_error",
}


def refuse_optax_order(fn: Any, kind: str) -> None:
    """An optax loss given as is: optax's losses take `(predictions, targets)` and return
    one value per example, where fuseloop calls `fn(y_true, y_pred)` (a loss for a scalar,
    a metric for per-example values), so the arguments would be swapped (and a shape
    error, or a `.mean()` added after one, would hide it). The message's wrapper keeps a
    partial's arguments and names the function where optax exports it."""
    keywords: dict[str, Any] = {}
    while isinstance(fn, functools.partial):  # partial(optax.sigmoid_focal_loss, gamma=2)
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    module = str(getattr(fn, "__module__", "") or "")
    if module != "optax" and not module.startswith("optax."):
        return
    name = getattr(fn, "__name__", "loss")
    path = f"optax.{name}" if getattr(optax, name, None) is fn else f"optax.losses.{name}"
    extra = "".join(f", {k}={v!r}" for k, v in keywords.items())
    call = f"{path}(y_pred, y_true{extra})"
    builtin = _BUILT_IN.get(name) if not keywords else None
    fix = (
        f"lambda y_true, y_pred: {call}.mean()"
        f"{f', or pass the built-in {builtin!r}, which is that loss' if builtin else ''}"
        if kind == "loss"
        else f"lambda y_true, y_pred: {call} (one value per example, which the metric "
        f"averages over the epoch's examples)"
    )
    raise ValueError(
        f"{kind}={path}: optax's losses take (predictions, targets), while fuseloop calls "
        f"a {kind} as {kind}(y_true, y_pred). Wrap it: {fix}"
    )
