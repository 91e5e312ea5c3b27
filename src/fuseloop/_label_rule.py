"""The values a named loss's labels must hold (`LabelRule`): class indices in range for a
sparse cross-entropy, probabilities in [0, 1] for a binary one, and the errors that name
the label, the loss and the fix. `_label_checks` applies the rule to a run's labels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ._batch_checks import numbers_fix

__all__ = ["LabelRule", "check_label_range", "is_numeric", "labels_below"]


def labels_below(labels: np.ndarray, classes: int) -> bool:
    """Whether every label is in [0, classes). Signed integers are read as unsigned, where
    a negative one is at least 2**(bits-1): one reduction instead of a min and a max,
    while the class count is at most that (int8 labels of 300 classes are not).

    Example:
        >>> labels_below(np.array([3, -1], np.int8), 10), labels_below(np.array([-1], np.int8), 300)
        (False, False)
    """
    if labels.dtype.kind == "i" and classes <= np.iinfo(labels.dtype).max + 1:
        return bool(labels.view(labels.dtype.str.replace("i", "u")).max() < classes)
    return bool(labels.min() >= 0 and labels.max() < classes)


def is_numeric(dtype: np.dtype) -> bool:
    """Whether labels of `dtype` are numbers: numpy's kinds, and the ml_dtypes floats
    (bfloat16, float8_*), which numpy reports as kind "V".

    Example:
        >>> is_numeric(np.dtype(jax.numpy.bfloat16)), is_numeric(np.dtype("U3"))
        (True, False)
    """
    return dtype.kind in "biuf" or bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


def check_label_range(labels: np.ndarray, classes: int, loss: str, where: str) -> None:
    """Raises a ValueError naming the label, the loss and the fix unless every label of
    `labels` (integers for the sparse loss `loss`) is in [0, classes)."""
    if labels_below(labels, classes):
        return
    low, high = labels.min(), labels.max()
    fix = (
        "Fix the labels (a negative one, such as -1 for 'unknown', has no class to "
        "train towards: drop or remap those examples; padding tokens such as -100 need a "
        "loss of your own that masks them, e.g. y as (labels, mask))"
        if low < 0
        else f"Fix the labels, or give the model's last layer at least {int(high) + 1} units"
    )
    if low >= 0 and high == 255 and classes < 255:  # segmentation's usual ignore index
        fix += (
            "; where 255 marks pixels to ignore, as in VOC or Cityscapes masks, a loss of "
            "your own that masks them (y as (labels, mask), or labels != 255)"
        )
    if labels.dtype.kind == "i" and low == np.iinfo(labels.dtype).min:
        fix = (
            f"{low} is what a missing (NaN) float label becomes when cast to "
            f"{labels.dtype}: drop or fill the missing labels before the cast"
        )
    raise ValueError(
        f"data: {where}: y holds the label {low if low < 0 else high}, out of range for "
        f"{loss} with a model output of {classes} classes (labels must be "
        f"integers in [0, {classes})). {fix}"
    )


@dataclass(frozen=True)
class LabelRule:
    """The values a named loss's labels must hold, checked on the host for numpy labels:
    class indices in [0, classes) for a sparse cross-entropy, probabilities in [0, 1]
    for `binary_cross_entropy` (`classes` None). Out of range, the loss trains on
    something else without failing (a binary cross-entropy with a target of 2 goes
    negative), so it is an error.

    Example:
        >>> import numpy as np
        >>> LabelRule("binary_cross_entropy").holds(np.array([0.0, 0.3, 1.0]))
        True
        >>> LabelRule("sparse_categorical_cross_entropy", 3).holds(np.array([0, 3]))
        False
    """

    loss: str
    classes: int | None = None

    def holds(self, labels: np.ndarray) -> bool:
        if not is_numeric(labels.dtype):
            return False  # `check` names the dtype
        if self.classes is not None:
            return labels_below(labels, self.classes)
        return bool(labels.min() >= 0 and labels.max() <= 1)  # a NaN fails both

    def bad(self, labels: np.ndarray) -> np.ndarray:
        """Where `labels` is out of range, element by element."""
        if self.classes is not None:
            return (labels < 0) | (labels >= self.classes)
        return ~((labels >= 0) & (labels <= 1))

    def check(self, labels: np.ndarray, where: str) -> None:
        """Raises a ValueError naming the label, the loss and the fix unless it holds."""
        if not is_numeric(labels.dtype):  # strings, objects: no range to check
            takes, cast, mapping = (
                (
                    f"integer class labels in [0, {self.classes})",
                    "int32",
                    "map them to integers, e.g. classes, y = np.unique(y, return_inverse=True)",
                )
                if self.classes is not None
                else ("targets in [0, 1] (1 for the positive class)", "float32", "map them to 0/1")
            )
            raise ValueError(
                f"data: {where}: y has dtype {labels.dtype}, not numbers; {self.loss} takes "
                f"{takes}: {numbers_fix('y', labels, cast, mapping)}"
            )
        if self.classes is not None:
            check_label_range(labels, self.classes, self.loss, where)
        elif not self.holds(labels):
            index = tuple(int(i) for i in np.argwhere(self.bad(labels))[0])
            value = labels[index]
            raise ValueError(
                f"data: {where}: y holds the target {value}, out of range for {self.loss} "
                f"(targets are probabilities in [0, 1]: 1 for the positive class, 0 for the "
                f"negative), first at index {index}. {_target_fix(labels, value)}"
            )


def _target_fix(labels: np.ndarray, value: Any) -> str:
    """The fix for a binary target out of [0, 1], from what the targets hold."""
    if np.isnan(value):
        return (
            "A NaN target is a missing label: drop those examples, or fill them, before "
            "training (a NaN target makes the loss NaN)"
        )
    kept = labels[~np.isnan(labels)] if labels.dtype.kind == "f" else labels
    distinct = np.unique(kept)
    if -1 in distinct and set(distinct.tolist()) <= {-1, 1}:  # a batch may hold only -1
        return "Map labels of -1/1 to 0/1, e.g. y = (y == 1)"
    if distinct.size == 2:
        return (
            f"Map the two classes' labels {distinct[0]}/{distinct[1]} to 0/1, e.g. "
            f"y = (y == {distinct[1]})"
        )
    shown = ", ".join(str(v) for v in distinct[:5]) + (", ..." if distinct.size > 5 else "")
    return (
        f"The targets checked hold {distinct.size} distinct values ({shown}): for more than "
        f"two classes use 'sparse_categorical_cross_entropy' with integer labels; otherwise "
        f"fix the targets out of [0, 1], or use a loss of your own for another range"
    )
