"""What a model returns, read for the built-in losses and metrics: one array of predictions,
or an error that describes the tuple or dict it returned and how to pick from it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

__all__ = [
    "NoTargetsError",
    "describe_outputs",
    "losses_per_output",
    "require_arrays",
    "require_one_prediction",
    "targets_misfit",
]


def describe_outputs(y_pred: Any, label: str = "output") -> str | None:
    """How a model's output that is not one array reads in an error ("a tuple of 2 outputs
    (output[0] of shape (4, 3), output[1] of shape (4, 8))"), or None for one array (or a
    Python scalar: not a container of outputs).

    Example:
        >>> import numpy as np
        >>> describe_outputs((np.zeros((4, 3)), np.zeros((4, 8))))
        'a tuple of 2 outputs (output[0] of shape (4, 3), output[1] of shape (4, 8))'
        >>> describe_outputs({"logits": np.zeros((4, 3))})
        "a dict of 1 output (output['logits'] of shape (4, 3))"
        >>> describe_outputs(np.zeros((4, 3))) is None
        True
    """
    if hasattr(y_pred, "shape") and hasattr(y_pred, "ndim"):
        return None
    noun = "output" if label == "output" else "array"
    leaves, treedef = jax.tree_util.tree_flatten_with_path(y_pred)
    if leaves and jax.tree_util.treedef_is_leaf(treedef):  # a scalar, not a container
        return None
    kind = "dict" if isinstance(y_pred, Mapping) else type(y_pred).__name__
    if not leaves:
        return "None" if y_pred is None else f"an empty {kind} (no arrays)"
    items = _items(y_pred)
    count = len(items) if items is not None else len(leaves)
    shapes = ", ".join(
        f"{label}{jax.tree_util.keystr(path)} of shape {tuple(np.shape(leaf))}"
        for path, leaf in leaves
    )
    return f"a {kind} of {count} {noun}{'s' if count != 1 else ''} ({shapes})"


def _items(y: Any) -> list[str] | None:
    """How each top-level item of a tuple, list or dict `y` that holds an array is picked
    (`[0]`, `['key']`, `.field` of a NamedTuple), None-valued items left out; None where
    `y` is another container."""
    if isinstance(y, Mapping):
        pairs = [(f"[{key!r}]", item) for key, item in y.items()]
    elif isinstance(y, tuple) and hasattr(y, "_fields"):  # a NamedTuple
        pairs = [(f".{field}", getattr(y, field)) for field in y._fields]
    elif isinstance(y, (tuple, list)):
        pairs = [(f"[{i}]", item) for i, item in enumerate(y)]
    else:
        return None
    return [pick for pick, item in pairs if jax.tree.leaves(item)]


def _first_output(y_pred: Any, name: str = "y_pred", usual: str = "logits") -> str:
    """How to pick the first of several outputs: `y_pred[0]`, `y_pred['key']` (`usual`
    where there is one) or a NamedTuple's `y_pred.field`."""
    if isinstance(y_pred, Mapping) and usual in y_pred:
        return f"{name}[{usual!r}]"
    items = _items(y_pred)
    return f"{name}{items[0] if items else '[0]'}"


def require_one_prediction(y_pred: Any, kind: str, name: str) -> None:
    """Raises a ValueError if `y_pred`, which the built-in `kind` ("loss" or "metric")
    `name` reads, is a tuple or dict of outputs rather than one array of predictions.

    Example:
        >>> import numpy as np
        >>> require_one_prediction((np.zeros((4, 3)), np.zeros((4, 8))), "metric", "accuracy")
        Traceback (most recent call last):
        ...
        ValueError: metric 'accuracy' takes one array of predictions, but the model returns ...
    """
    outputs = describe_outputs(y_pred)
    if outputs is None:
        return
    pick = _first_output(y_pred)
    if kind == "metric":
        fix = (
            f"Pass a metric function that picks the output, e.g. .metric(lambda y_true, "
            f"y_pred: ..., name={name!r}) reading {pick}"
        )
    else:
        fix = (
            f"Pass a custom loss, loss(y_true, y_pred), that picks the output to train on "
            f"(e.g. {pick}, against {_first_output(y_pred, 'y_true')} where y holds a "
            f"target per output; a sum of each output's loss trains them all)"
        )
    raise ValueError(
        f"{kind} {name!r} takes one array of predictions, but the model returns {outputs}. "
        f"{fix}, or make the model return one array"
    )


class NoTargetsError(ValueError):
    """A built-in loss or metric given data without targets (`(x, None)`): raised as it
    is, not as y's misfit."""


def require_arrays(y_true: Any, y_pred: Any, kind: str, name: str) -> None:
    """`require_one_prediction`, and a ValueError where the targets `y_true` are not one
    array either (a dict of labels and weights, which only the user's function can read).

    Example:
        >>> import numpy as np
        >>> require_arrays({"y": np.zeros(4), "w": np.ones(4)}, np.zeros((4, 3)), "metric",
        ...                "accuracy")
        Traceback (most recent call last):
        ...
        ValueError: metric 'accuracy' takes y as one array of targets, but the data's y is ...
    """
    require_one_prediction(y_pred, kind, name)
    if not jax.tree.leaves(y_true):  # (x, None): data without labels
        own = (
            f".metric(lambda y_true, y_pred: ..., name={name!r})"
            if kind == "metric"
            else "loss=lambda y_true, y_pred: ..."
        )
        rebuilds = name in ("mean_squared_error", "mean_absolute_error", "binary_cross_entropy")
        given = (
            "for a model that rebuilds x (an autoencoder), give x as the targets too, "
            "fl.data.arrays(x, x, ...), and otherwise the data its labels"
            if rebuilds
            else "give the data its labels, fl.data.arrays(x, y, ...)"
        )
        raise NoTargetsError(
            f"data: {kind} {name!r} compares predictions with targets, but the data holds "
            f"none (y is {y_true!r}): {given}; or pass a {kind} function of the predictions "
            f"alone, e.g. {own}"
        )
    targets = describe_outputs(y_true, label="y")
    if targets is None:
        return
    pick = _first_output(y_true, "y_true", "y")
    if kind == "metric":
        fix = f"Pass a metric function, e.g. .metric(lambda y_true, y_pred: ..., name={name!r})"
    else:
        fix = "Pass a custom loss, loss(y_true, y_pred)"
    raise ValueError(
        f"{kind} {name!r} takes y as one array of targets, but the data's y is {targets}. "
        f"{fix}, that reads the targets from it (e.g. {pick}, weighing by any weights it "
        f"holds), or make y one array"
    )


def losses_per_output(loss: Any) -> str:
    """Advice where `loss` is Keras's losses per output (a dict or list of them)."""
    if not isinstance(loss, (dict, list, tuple)):
        return ""
    return (
        ". Keras's losses per output are one function here: loss(y_true, y_pred) "
        "returning the sum of each output's loss (weighted as you like), e.g. "
        "optax.softmax_cross_entropy_with_integer_labels(y_pred['a'], y_true['a']).mean() "
        "+ jnp.mean((y_pred['b'] - y_true['b']) ** 2)"
    )


def targets_misfit(y_shape: tuple[int, ...], out_shape: tuple[int, ...], name: str) -> str:
    """The message for targets of `y_shape` that the built-in `name`, reading one target
    per output, cannot compare with an output of `out_shape`. One target per example
    against several outputs per example (a mean and a log-variance, quantiles) is told to
    pick the output the metric compares."""
    one_per_example = math.prod(y_shape[1:]) == 1 and len(y_shape) >= 1
    several = len(out_shape) == 2 and out_shape[-1] > 1 and out_shape[:1] == y_shape[:1]
    pick = (
        "; where the output holds several values per example (a mean and a log-variance), "
        "pass a loss or metric function of your own that reads the one to compare "
        "(y_pred[:, 0] against y_true)"
        if one_per_example and several
        else ""
    )
    return (
        f"data: y has shape {y_shape}, but {name} with the model's output of shape "
        f"{out_shape} expects targets of that shape (trailing 1s aside); reshape or "
        f"transpose y, or change the model's last layer{pick}"
    )
