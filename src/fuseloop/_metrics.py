"""Losses, metric functions and their on-device accumulators.

Accumulators keep a sum and a count and divide only when read on the host. A running
average written as `(avg * n + x) / (n + 1)` invites XLA to contract a multiply-add
differently in a separately jitted step and in a scanned loop (DESIGN.md §2); a sum has no
multiply to contract, so fused and unfused accumulators agree to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LOSSES", "METRICS", "resolve_loss", "resolve_metric", "MetricSpec", "ACCUMULATORS"]

Array = Any


def _sparse_cce(y_true: Array, y_pred: Array) -> Array:
    labels = jnp.asarray(y_true).astype(jnp.int32)
    if labels.ndim == y_pred.ndim:  # (batch, 1) labels
        labels = labels[..., 0]
    return optax.softmax_cross_entropy_with_integer_labels(y_pred, labels).mean()


def _cce(y_true: Array, y_pred: Array) -> Array:
    return optax.softmax_cross_entropy(y_pred, y_true.astype(y_pred.dtype)).mean()


def _bce(y_true: Array, y_pred: Array) -> Array:
    y_true = jnp.reshape(y_true, y_pred.shape).astype(y_pred.dtype)
    return optax.sigmoid_binary_cross_entropy(y_pred, y_true).mean()


def _mse(y_true: Array, y_pred: Array) -> Array:
    return jnp.mean(jnp.square(y_pred - jnp.reshape(y_true, y_pred.shape)))


def _mae(y_true: Array, y_pred: Array) -> Array:
    return jnp.mean(jnp.abs(y_pred - jnp.reshape(y_true, y_pred.shape)))


LOSSES: dict[str, Callable[[Array, Array], Array]] = {
    "mean_squared_error": _mse,
    "mean_absolute_error": _mae,
    "binary_cross_entropy": _bce,
    "categorical_cross_entropy": _cce,
    "sparse_categorical_cross_entropy": _sparse_cce,
}


def _predicted_and_true_classes(y_true: Array, y_pred: Array) -> tuple[Array, Array]:
    """Class predictions for the three label layouts: sparse, one-hot and binary logits."""
    if y_pred.ndim >= 1 and y_pred.shape[-1] > 1:
        predicted = jnp.argmax(y_pred, axis=-1)
        if y_true.shape == y_pred.shape:  # one-hot or probabilities
            return jnp.argmax(y_true, axis=-1), predicted
        labels = y_true[..., 0] if y_true.ndim == y_pred.ndim else y_true
        return labels.astype(jnp.int32), predicted
    # Binary: a single logit per example, thresholded at 0 (probability 0.5).
    return jnp.reshape(y_true, y_pred.shape) > 0.5, y_pred > 0


def _accuracy(y_true: Array, y_pred: Array) -> Array:
    true, predicted = _predicted_and_true_classes(y_true, y_pred)
    return jnp.mean((true == predicted).astype(jnp.float32))


def _binary_counts(y_true: Array, y_pred: Array) -> tuple[Array, Array, Array]:
    true, predicted = _predicted_and_true_classes(y_true, y_pred)
    if y_pred.ndim >= 1 and y_pred.shape[-1] > 1:  # multi-class: class 1 is "positive"
        true, predicted = true == 1, predicted == 1
    true_pos = jnp.sum((true & predicted).astype(jnp.float32))
    return true_pos, jnp.sum(predicted.astype(jnp.float32)), jnp.sum(true.astype(jnp.float32))


def _precision(y_true: Array, y_pred: Array) -> Array:
    true_pos, predicted_pos, _ = _binary_counts(y_true, y_pred)
    return jnp.where(predicted_pos > 0, true_pos / jnp.maximum(predicted_pos, 1.0), 0.0)


def _recall(y_true: Array, y_pred: Array) -> Array:
    true_pos, _, actual_pos = _binary_counts(y_true, y_pred)
    return jnp.where(actual_pos > 0, true_pos / jnp.maximum(actual_pos, 1.0), 0.0)


METRICS: dict[str, Callable[[Array, Array], Array]] = {
    "accuracy": _accuracy,
    "precision": _precision,
    "recall": _recall,
    "mean_absolute_error": _mae,
    "mean_squared_error": _mse,
}

ACCUMULATORS = ("running_average", "running_sum")


def resolve_loss(loss: Any) -> tuple[str, Callable[[Array, Array], Array]]:
    """Returns `(name, fn)` for a loss name or callable."""
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(
                f"loss={loss!r} is not a known loss; accepted values: {', '.join(LOSSES)} "
                f"or a callable(y_true, y_pred) -> scalar"
            )
        return loss, LOSSES[loss]
    if callable(loss):
        return getattr(loss, "__name__", "loss"), loss
    raise ValueError(
        f"loss={loss!r} must be a name ({', '.join(LOSSES)}) or a callable(y_true, y_pred)"
    )


@dataclass(frozen=True)
class MetricSpec:
    """A metric attached to a loop: its name, function and accumulator.

    `fn(y_true, y_pred) -> scalar`. `source` names a scalar in the step state to read
    instead (how a custom loop exposes its loss).
    """

    name: str
    fn: Callable[[Array, Array], Array] | None
    accumulate: str = "running_average"
    source: str | None = None

    def init(self) -> dict[str, Array]:
        return {"sum": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.float32)}

    def update(self, acc: dict[str, Array], value: Array) -> dict[str, Array]:
        value = jnp.asarray(value, jnp.float32)
        return {"sum": acc["sum"] + value, "count": acc["count"] + 1.0}


def resolve_metric(metric: Any, name: str | None, accumulate: str) -> MetricSpec:
    """Validates `Loop.metric` arguments and returns a `MetricSpec`."""
    if accumulate not in ACCUMULATORS:
        raise ValueError(
            f"accumulate={accumulate!r} is not an accumulator; accepted values: "
            f"{', '.join(ACCUMULATORS)}"
        )
    if isinstance(metric, str):
        if metric not in METRICS:
            raise ValueError(
                f"metric={metric!r} is not a known metric; accepted values: "
                f"{', '.join(METRICS)} or a callable(y_true, y_pred) -> scalar"
            )
        return MetricSpec(name or metric, METRICS[metric], accumulate)
    if callable(metric):
        return MetricSpec(name or getattr(metric, "__name__", "metric"), metric, accumulate)
    raise ValueError(
        f"metric={metric!r} must be a name ({', '.join(METRICS)}) or a callable(y_true, y_pred)"
    )


def read_metric(spec: MetricSpec, acc: dict[str, np.ndarray]) -> float:
    """The host-side value of an accumulator that was already read to the host."""
    total = np.float32(acc["sum"])
    if spec.accumulate == "running_sum":
        return float(total)
    count = np.float32(acc["count"])
    return float(total / count) if count > 0 else float("nan")
