"""Losses, metric functions and their on-device accumulators.

Accumulators keep a sum and a count and divide only when read on the host. A running
average written as `(avg * n + x) / (n + 1)` invites XLA to contract a multiply-add
differently in a separately jitted step and in a scanned loop; a sum has no multiply to
contract, so fused and unfused accumulators agree to the bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._arg_types import refuse_signature
from ._outputs import losses_per_output, require_arrays, targets_misfit
from ._sums import (
    Mean,
    accumulate,
    accumulated,
    accumulator_dtype,
    empty_accumulator,
    mean_of,
    refuse_unsummable,
)
from ._target_shapes import refusing_cross_broadcast

__all__ = [
    "LOSSES",
    "PER_ELEMENT_LOSSES",
    "METRICS",
    "Mean",
    "resolve_loss",
    "resolve_metric",
    "MetricSpec",
    "ACCUMULATORS",
    "batch_size",
    "VALIDATION_PREFIX",
]

Array = Any


def _sparse_labels(y_true: Array, y_pred: Array) -> Array:
    labels = jnp.asarray(y_true).astype(jnp.int32)
    if labels.ndim == y_pred.ndim:  # (batch, 1) labels
        labels = labels[..., 0]
    return labels


def _sparse_cce_each(y_true: Array, y_pred: Array) -> Array:
    labels = _sparse_labels(y_true, y_pred)
    each = optax.softmax_cross_entropy_with_integer_labels(y_pred, labels)
    # A label past the last class reads NaN; a negative one would count from the end (a
    # real class) and train: NaN too, for labels no host check read (already on device).
    return jnp.where(labels < 0, jnp.nan, each)


def _targets(y_true: Array, y_pred: Array) -> Array:
    """Targets as a built-in cross-entropy takes them: integers in the output's dtype,
    floats as optax takes them (f32 soft targets of bf16 logits stay f32: in bf16, 0.92 +
    0.02 is 1.002), though no wider than the output's dtype or float32, the wider."""
    if not jnp.issubdtype(y_true.dtype, jnp.floating):
        return y_true.astype(y_pred.dtype)
    widest = jnp.promote_types(y_pred.dtype, jnp.float32)
    return y_true if jnp.promote_types(y_true.dtype, widest) == widest else y_true.astype(widest)


def _cce_each(y_true: Array, y_pred: Array) -> Array:
    return optax.softmax_cross_entropy(y_pred, _targets(y_true, y_pred))


def fits_output(shape: tuple[int, ...], output: tuple[int, ...]) -> bool:
    """Whether targets of `shape` are the output's `shape` but for trailing 1s, the only
    difference a built-in loss or metric reshapes away: (B,) against (B, 1), not a
    transposed (B, C, T) against (B, T, C), which holds as many values.

    Example:
        >>> fits_output((8,), (8, 1)), fits_output((8, 2, 3), (8, 3, 2))
        (True, False)
    """

    def significant(dims: tuple[int, ...]) -> tuple[int, ...]:
        while dims and dims[-1] == 1:
            dims = dims[:-1]
        return dims

    return tuple(shape[:1]) == tuple(output[:1]) and significant(shape) == significant(output)


def _like_output(y_true: Array, y_pred: Array, name: str) -> Array:
    if not fits_output(jnp.shape(y_true), jnp.shape(y_pred)):
        raise ValueError(targets_misfit(jnp.shape(y_true), jnp.shape(y_pred), name))
    return jnp.reshape(y_true, y_pred.shape)


def _bce_each(y_true: Array, y_pred: Array) -> Array:
    y_true = _like_output(y_true, y_pred, "binary_cross_entropy")
    return optax.sigmoid_binary_cross_entropy(y_pred, _targets(y_true, y_pred))


def _mse_each(y_true: Array, y_pred: Array) -> Array:
    d = y_pred - _like_output(y_true, y_pred, "mean_squared_error")
    return jnp.real(d * jnp.conj(d)) if jnp.iscomplexobj(d) else jnp.square(d)  # |d|^2


def _mae_each(y_true: Array, y_pred: Array) -> Array:
    return jnp.abs(y_pred - _like_output(y_true, y_pred, "mean_absolute_error"))


def _in_float32(each: Callable[[Array, Array], Array]) -> Callable[[Array, Array], Array]:
    """`each` computed from outputs of at least float32: a bf16 model's log-softmax rounded
    each example's loss to bf16 (2e-4 relative over 1,000 classes), where Keras and the
    usual mixed-precision recipe compute losses in float32. Its gradient reaches the
    model's bf16 outputs rounded once."""

    def wide(y_true: Array, y_pred: Array) -> Array:
        dtype = getattr(y_pred, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            y_pred = y_pred.astype(jnp.float32)
        return each(y_true, y_pred)

    wide.__name__ = each.__name__
    return wide


# Per-element losses: the training objective is their mean over the batch, and the "loss"
# metric accumulates their sum and count, so its epoch value is the mean over all examples.
PER_ELEMENT_LOSSES: dict[str, Callable[[Array, Array], Array]] = {
    "mean_squared_error": _in_float32(_mse_each),
    "mean_absolute_error": _in_float32(_mae_each),
    "binary_cross_entropy": _in_float32(_bce_each),
    "categorical_cross_entropy": _in_float32(_cce_each),
    "sparse_categorical_cross_entropy": _in_float32(_sparse_cce_each),
}


def _batch_mean(
    name: str, each: Callable[[Array, Array], Array]
) -> Callable[[Array, Array], Array]:
    def loss(y_true: Array, y_pred: Array) -> Array:
        require_arrays(y_true, y_pred, "loss", name)
        return each(y_true, y_pred).mean()

    loss.__name__ = each.__name__.removesuffix("_each").lstrip("_")
    return loss


LOSSES: dict[str, Callable[[Array, Array], Array]] = {
    name: _batch_mean(name, each) for name, each in PER_ELEMENT_LOSSES.items()
}

# Keras's spellings of the same losses and metrics, so a Keras user's strings work as they
# wrote them (a metric keeps the name it was given, as Keras's history does).
ALIASES = {
    "mse": "mean_squared_error",
    "mae": "mean_absolute_error",
    "binary_crossentropy": "binary_cross_entropy",
    "categorical_crossentropy": "categorical_cross_entropy",
    "sparse_categorical_crossentropy": "sparse_categorical_cross_entropy",
    "acc": "accuracy",
}


def _predicted_and_true_classes(
    y_true: Array, y_pred: Array, metric: str, binary: bool
) -> tuple[Array, Array]:
    """Class predictions for the label layouts: binary logits (one per example, or one per
    label under binary cross-entropy: `binary`), sparse labels and one-hot labels
    (`metric`: the built-in metric asking, named if y_pred is not one array)."""
    require_arrays(y_true, y_pred, "metric", metric)
    if binary or y_pred.ndim < 2 or y_pred.shape[-1] == 1:
        # Each output a logit, thresholded at 0 (probability 0.5), against a 0/1 label.
        return _like_output(y_true, y_pred, metric) > 0.5, y_pred > 0
    predicted = jnp.argmax(y_pred, axis=-1)
    if y_true.shape == y_pred.shape:  # one-hot or probabilities
        return jnp.argmax(y_true, axis=-1), predicted
    if y_true.shape != predicted.shape and y_true.shape != (*predicted.shape, 1):
        raise ValueError(
            f"data: y has shape {y_true.shape}, but {metric} with the model's output of shape "
            f"{y_pred.shape} expects class labels of shape {predicted.shape} (or "
            f"{(*predicted.shape, 1)}) or one-hot targets of the output's shape"
        )
    labels = y_true[..., 0] if y_true.ndim == y_pred.ndim else y_true
    return labels.astype(jnp.int32), predicted


def _accuracy(y_true: Array, y_pred: Array, binary: bool = False) -> Mean:
    true, predicted = _predicted_and_true_classes(y_true, y_pred, "accuracy", binary)
    return mean_of(true == predicted)


def _binary_counts(
    y_true: Array, y_pred: Array, metric: str, binary: bool
) -> tuple[Array, Array, Array]:
    """True positives, predicted positives and actual positives. For one class among
    several (multi-class), micro-averaged over the classes: every example is one predicted
    and one actual positive, and a true positive where the two agree."""
    true, predicted = _predicted_and_true_classes(y_true, y_pred, metric, binary)
    if true.dtype != jnp.bool_:  # class indices: multi-class
        examples = jnp.asarray(true.size, jnp.float32)
        return jnp.sum((true == predicted).astype(jnp.float32)), examples, examples
    true_pos = jnp.sum((true & predicted).astype(jnp.float32))
    return true_pos, jnp.sum(predicted.astype(jnp.float32)), jnp.sum(true.astype(jnp.float32))


# Precision is true positives over predicted positives, summed over the epoch. A batch with
# no predicted positive still adds this tiny count, so an epoch without any reads 0.0 (as in
# Keras), not nothing; far below half an ulp of any count >= 1, a real count stays exact.
_PRESENT = 2.0**-100


def _precision(y_true: Array, y_pred: Array, binary: bool = False) -> Mean:
    true_pos, predicted_pos, _ = _binary_counts(y_true, y_pred, "precision", binary)
    return Mean(true_pos, predicted_pos + _PRESENT)


def _recall(y_true: Array, y_pred: Array, binary: bool = False) -> Mean:
    true_pos, _, actual_pos = _binary_counts(y_true, y_pred, "recall", binary)
    return Mean(true_pos, actual_pos + _PRESENT)


def _mae(y_true: Array, y_pred: Array) -> Mean:
    require_arrays(y_true, y_pred, "metric", "mean_absolute_error")
    return mean_of(PER_ELEMENT_LOSSES["mean_absolute_error"](y_true, y_pred))


def _mse(y_true: Array, y_pred: Array) -> Mean:
    require_arrays(y_true, y_pred, "metric", "mean_squared_error")
    return mean_of(PER_ELEMENT_LOSSES["mean_squared_error"](y_true, y_pred))


# Built-in metrics return a `Mean`: their epoch value is a mean over examples (precision and
# recall: over predicted and actual positives), whatever the batch sizes.
METRICS: dict[str, Callable[[Array, Array], Mean]] = {
    "accuracy": _accuracy,
    "precision": _precision,
    "recall": _recall,
    "mean_absolute_error": _mae,
    "mean_squared_error": _mse,
}

# The built-in metrics that read classes: under binary cross-entropy every output is a
# binary label of its own (one per example, or several: multi-label), as Keras's
# "accuracy" becomes binary accuracy there.
CLASSIFYING = frozenset({_accuracy, _precision, _recall})

ACCUMULATORS = ("running_average", "running_sum")

# What validate() puts before a metric's name for its value on held-out data (the host's
# Validator and the device-side validation of a whole-run dispatch alike).
VALIDATION_PREFIX = "validation_"


def resolve_loss(loss: Any) -> tuple[str, Callable[[Array, Array], Array]]:
    """Returns `(name, fn)` for a loss name or callable."""
    if isinstance(loss, str):
        name = ALIASES.get(loss, loss)
        if name not in LOSSES:
            raise ValueError(
                f"loss={loss!r} is not a known loss; accepted values: {', '.join(LOSSES)} "
                f"(or Keras's spellings: {_aliases_of(LOSSES)}) or a callable(y_true, y_pred) "
                f"-> scalar"
            )
        return name, LOSSES[name]
    if callable(loss):
        refuse_signature(loss, "loss", "loss(y_true, y_pred)")
        name = getattr(loss, "__name__", "loss")
        return name, refusing_cross_broadcast(loss, "loss", name)
    order = "; it is an optimizer: the order is fl.trainer(model, loss, optimizer)"
    optimizer = hasattr(loss, "init") and hasattr(loss, "update")  # (model, optimizer, loss)
    raise ValueError(
        f"loss={loss!r} must be a name ({', '.join(LOSSES)}) or a callable(y_true, y_pred)"
        f"{order if optimizer else losses_per_output(loss)}"
    )


@dataclass(frozen=True)
class MetricSpec:
    """A metric attached to a loop: its name, function and accumulator.

    `fn(y_true, y_pred)` returns a `Mean` (built-in metrics: the epoch value is a mean over
    examples), an array of per-example values (a user's callable, as Keras metric
    functions return: the epoch value is their mean over the epoch's examples) or a scalar
    (a user's callable: the epoch value is the mean of the per-batch scalars, each batch
    weighing the same). `source` names a scalar in the step state to read instead (how a
    custom loop exposes its loss).
    """

    name: str
    fn: Callable[[Array, Array], Any] | None
    accumulate: str = "running_average"
    source: str | None = None

    def init(self) -> dict[str, Array]:
        return empty_accumulator()  # compensated sums: `_sums.accumulate`

    def update(self, acc: dict[str, Array], value: Any) -> dict[str, Array]:
        """`acc` plus one batch: a `Mean` adds its sum and example count, per-example
        values their sum and number, a scalar itself and a count of one (a running sum
        counts batches, so it reads as present)."""
        refuse_unsummable(value, f"metric {self.name!r}")
        dtype = accumulator_dtype()
        if isinstance(value, Mean):
            total = jnp.asarray(value.total, dtype)
            count = jnp.asarray(value.count, dtype)
        elif jnp.ndim(value) > 0:  # per-example values: a mean over examples
            total, count = mean_of(value)
        else:
            total, count = jnp.asarray(value, dtype), jnp.ones((), dtype)
        if self.accumulate == "running_sum":
            count = jnp.ones((), dtype)
        if self.accumulate == "last":  # the value of the latest step (a learning rate)
            return {**self.init(), "sum": total, "count": count}
        return accumulate(acc, total, count)


def batch_size(tree: Any, fallback: Any = None) -> int:
    """The leading-axis size of the first leaf of `tree` that has one (a per-batch scalar,
    `{"alpha": 1.0, "y": ...}`, has none), else of `fallback`'s (x, beside targets that
    hold no example axis: None, a dummy label 0), else 1."""
    axes = (np.shape(leaf) for leaf in jax.tree.leaves((tree, fallback)))
    return next((int(shape[0]) for shape in axes if len(shape) >= 1), 1)


def loss_mean(loss: Any) -> Callable[[Array, Array, Any], tuple[Array, Mean]]:
    """`fn(y_true, y_pred, x) -> (batch loss, Mean)` for a loss name or callable.

    A named loss is a mean of per-element losses: the batch loss (the training objective)
    is their mean, and the `Mean` holds their sum and count. A callable returns the batch's
    loss only; it is taken as a mean over the batch's examples and weighted by their number
    (the leading axis of y_true, or of `x` where no leaf of y has one: an autoencoder's
    `(x, None)`, a dummy label), as Keras weighs its loss tracker.
    """
    name, fn = resolve_loss(loss)
    each = PER_ELEMENT_LOSSES.get(name) if isinstance(loss, str) else None  # name: resolved

    def weighted(y_true: Array, y_pred: Array, x: Any = None) -> tuple[Array, Mean]:
        value = fn(y_true, y_pred)
        n = jnp.asarray(batch_size(y_true, x), accumulator_dtype())
        return value, Mean(jnp.asarray(value, n.dtype) * n, n)

    if each is None:
        return weighted
    per_element = each

    def named(y_true: Array, y_pred: Array, x: Any = None) -> tuple[Array, Mean]:
        require_arrays(y_true, y_pred, "loss", name)
        values = per_element(y_true, y_pred)
        return values.mean(), mean_of(values)

    return named


def resolve_metric(metric: Any, name: str | None, accumulate: str) -> MetricSpec:
    """Validates `Loop.metric` arguments and returns a `MetricSpec`."""
    if accumulate not in ACCUMULATORS:
        raise ValueError(
            f"accumulate={accumulate!r} is not an accumulator; accepted values: "
            f"{', '.join(ACCUMULATORS)}"
        )
    if isinstance(metric, str):
        known = ALIASES.get(metric, metric)
        if known not in METRICS:
            raise ValueError(
                f"metric={metric!r} is not a known metric; accepted values: "
                f"{', '.join(METRICS)} (or Keras's spellings: {_aliases_of(METRICS)}) or a "
                f"callable(y_true, y_pred) returning per-example values or a scalar"
            )
        return MetricSpec(name or metric, METRICS[known], accumulate)
    if callable(metric):
        refuse_signature(metric, "metric", "metric(y_true, y_pred)")
        label = name or str(getattr(metric, "__name__", "metric"))
        return MetricSpec(label, refusing_cross_broadcast(metric, "metric", label), accumulate)
    raise ValueError(
        f"metric={metric!r} must be a name ({', '.join(METRICS)}) or a callable(y_true, y_pred)"
    )


def _aliases_of(names: dict[str, Any]) -> str:
    return ", ".join(alias for alias, name in ALIASES.items() if name in names)


def read_metric(spec: MetricSpec, acc: dict[str, np.ndarray]) -> float:
    """The host-side value of an accumulator that was already read to the host."""
    # Numpy scalars of the accumulator's dtype: the device's roundings (`device_value`).
    total, count = accumulated({key: np.asarray(value)[()] for key, value in acc.items()})
    if spec.accumulate in ("running_sum", "last"):
        return float(total)
    if count <= 0:
        return float("nan")
    if count < 1:  # precision/recall: no positive in the epoch, only the presence marks
        return 0.0
    return float(total / count)
