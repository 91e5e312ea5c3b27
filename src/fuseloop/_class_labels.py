"""The labels the built-in class metrics ("accuracy", "precision", "recall", ...) can read.

Those metrics read one class per example: the argmax of a row of outputs against the
argmax of a row of labels shaped as the outputs or against a class index, or, for a model
of one output per example, that output as a binary logit against a 0/1 target. Labels of
another kind are scored as something else without failing: a multi-hot row is compared by
its argmax, a class index of 2 or a regression target is thresholded at 0.5, an index
outside the outputs' classes (padding's -100) never matches. Which rule applies is
known from the model's output shape and the first batch's labels (`class_label_rule`,
once per Loop); every label the run trains on is then held to it (`_label_checks`):
an in-memory dataset's at once, other data's batch by batch as they arrive
(docs/design.md §6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ClassLabels", "class_label_rule", "readable"]

_TOLERANCE = 1e-3  # how far from 1 a row of float32 probabilities may sum


_PADDING_FIX = (
    "To leave padded labels out, track the correct count and the count of real labels as "
    "two metrics of your own with accumulate='running_sum' and divide them (README)"
)


@dataclass(frozen=True)
class ClassLabels:
    """The labels class metrics read as meant: rows that sum to 1 (one-hot or
    probabilities) where the labels are shaped as the model's output (`per_row`), else
    targets in [0, 1] or -1/+1 for a model of one output per example.

    Example:
        >>> import numpy as np
        >>> rule = ClassLabels(("accuracy",), (8, 3), per_row=True)
        >>> rule.holds(np.eye(3)[[0, 2]]), rule.holds(np.array([[1.0, 1.0, 0.0]]))
        (True, False)
        >>> ClassLabels(("accuracy",), (8,), per_row=False).holds(np.array([0.0, -1.0, 2.0]))
        False
    """

    metrics: tuple[str, ...]
    output: tuple[int, ...]
    per_row: bool
    classes: int = 0  # labels are class indices below it (0: they are not indices)

    def bad(self, labels: Any) -> np.ndarray:
        """Where `labels` break the rule: row by row, else element by element."""
        values = np.asarray(labels, np.float64)
        if self.per_row:
            return np.abs(values.sum(axis=-1) - 1.0) > _TOLERANCE  # (a NaN row passes)
        if self.classes:
            return ~((values >= 0) & (values < self.classes) & (values == np.floor(values)))
        return ~(((values >= 0) & (values <= 1)) | (values == -1))

    def holds(self, labels: Any) -> bool:
        return not self.bad(labels).any()

    def check(self, labels: Any, where: str) -> None:
        """Raises a ValueError naming the label, the metrics and the fix unless it holds."""
        bad = self.bad(labels)
        if not bad.any():
            return
        values = np.asarray(labels, np.float64)
        listed = ", ".join(repr(name) for name in self.metrics)
        if self.per_row:
            sums = values.sum(axis=-1)[bad]
            several = sums > 1.0 + _TOLERANCE  # a multi-hot row says more than a padded one
            row_sum = sums[several].flat[0] if several.any() else sums.flat[0]
            if not several.any() and not values[bad][0].any():  # a one-hot of padding
                raise ValueError(
                    f"data: {where}: y has the model's output shape {self.output}, read by "
                    f"{listed} as one class per example (one-hot), but a row of y is all "
                    f"zeros (a padded position?): {listed} would score it as class 0 by "
                    f"its argmax, not leave it out. {_PADDING_FIX}"
                )
            raise ValueError(
                f"data: {where}: y has the model's output shape {self.output}, read by "
                f"{listed} as one class per example (one-hot or probabilities, each row "
                f"summing to 1), but a row of y sums to {row_sum:g} (multi-hot labels?): "
                f"{listed} would compare each row's argmax. For several labels per example, "
                f"pass loss='binary_cross_entropy' (fl.evaluator(model, "
                f"'binary_cross_entropy') to evaluate), which makes them element-wise, or a "
                f"metric of your own"
            )
        if self.classes:
            raise ValueError(
                f"data: {where}: y holds {values[bad].flat[0]:g}, but {listed} read y as "
                f"class indices of the model's {self.classes} outputs (0 to "
                f"{self.classes - 1}): a label outside them (padding, an ignore index such "
                f"as -100) would be scored as a wrong prediction, not left out. "
                f"{_PADDING_FIX}; to score every label, give the model an output per class"
            )
        raise ValueError(
            f"data: {where}: the model gives one output per example (shape {self.output}), "
            f"which {listed} read as a binary logit against 0/1 targets, but y holds "
            f"{values[bad].flat[0]:g}. For K classes, give the model K outputs and integer "
            f"labels (loss='sparse_categorical_cross_entropy'); for a regression, "
            f"track 'mean_absolute_error' or a metric of your own"
        )


def class_label_rule(
    metrics: Sequence[str], output: tuple[int, ...], y: Any, indices: bool = True
) -> ClassLabels | None:
    """The rule the class `metrics` hold labels like `y` (a run's first batch's) to, given
    the model's output shape (`()`: unknown); None where they read no labels of this kind
    or `y` is not one numeric array this process holds. `indices`: class indices are held
    to the output's classes (False where the loss's own label rule does it already).

    Example:
        >>> import numpy as np
        >>> class_label_rule(["accuracy"], (8, 3), np.zeros((8, 3))).per_row
        True
        >>> class_label_rule(["accuracy"], (8, 3), np.zeros(8, np.int32)).classes
        3
    """
    if not metrics or not output or not _numeric(y):
        return None
    if len(output) == 1 or output[-1] == 1:  # one output per example: a binary logit
        return ClassLabels(tuple(metrics), tuple(output), per_row=False)
    shape = tuple(y.shape)
    if len(shape) >= 2 and shape[1:] == tuple(output)[1:]:  # (output[-1] >= 2 here)
        return ClassLabels(tuple(metrics), tuple(output), per_row=True)
    if indices and shape[1:] in (tuple(output)[1:-1], (*output[1:-1], 1)):
        return ClassLabels(tuple(metrics), tuple(output), per_row=False, classes=output[-1])
    return None


def readable(y: Any) -> np.ndarray | None:
    """Targets (a batch's, or a dataset's) as float64 on the host, where they are one
    numeric array this process holds whole; None otherwise."""
    if not _numeric(y):
        return None
    return np.asarray(y, np.float64)  # host read: targets the user made before the run


def _numeric(y: Any) -> bool:
    """Whether `y` is one numeric (or bool) array this process holds whole."""
    if not isinstance(y, (np.ndarray, jax.Array)):
        return False
    # (JAX's dtypes know bfloat16, which numpy's do not call a number)
    if not (jnp.issubdtype(y.dtype, jnp.number) or y.dtype == np.bool_):
        return False
    return not (isinstance(y, jax.Array) and not y.is_fully_addressable)
