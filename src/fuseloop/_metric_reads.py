"""What a metric reads from one step (docs/design.md §2): a built-in or callable metric
of `(y_true, y_pred)`, the trainer's loss, or a scalar the step state holds (a custom
loop's). A name that could mean two of these is refused rather than read as one of them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._metrics import CLASSIFYING, METRICS, MetricSpec, batch_size
from ._model_fit_advice import describe
from ._target_shapes import CrossBroadcastError
from ._warn import warn

__all__ = ["metric_value"]

# What a step's `aux` holds besides the values a metric may read by name: the batch's
# labels, the predictions, the whole step state, its count of examples, and flags (`_step`).
_INTERNAL = frozenset({"y_true", "y_pred", "step_state", "binary_labels", "means", "examples"})
_BUILT_IN = tuple(METRICS.values())


def _not_a_dict(inner: Any, source: str) -> str:
    """Why a custom step state's own field was not read: metrics read dict keys only."""
    if inner is None or isinstance(inner, dict):
        return ""
    if hasattr(inner, source):
        return (
            f" (this step state's type is {type(inner).__name__}: a metric reads a dict's "
            f"keys by name, not an attribute such as its {source!r})"
        )
    return f" (this step state's type is {type(inner).__name__}, not a dict)"


def metric_value(spec: MetricSpec, aux: dict[str, Any]) -> Any:
    """The value `spec` reads from one step's `aux` (traced, inside the step)."""
    inner = aux.get("step_state")
    own = isinstance(inner, dict) and spec.name in inner
    if spec.source is not None:
        if spec.source in aux.get("means", {}):  # the trainer's or evaluator's own loss
            return aux["means"][spec.source]
        # A custom step's own state first: its "y_true" or "step_state" key is the user's,
        # not the batch's labels or the whole state that aux also holds under those names.
        if isinstance(inner, dict) and spec.source in inner:
            return _scalar_entry(spec, inner[spec.source])
        if spec.source in aux and spec.source not in _INTERNAL:
            return aux[spec.source]
        raise ValueError(
            f"metric {spec.name!r} reads {spec.source!r}, which the step does not produce; "
            f"return a dict step state holding a scalar {spec.source!r}"
            + _not_a_dict(inner, spec.source)
        )
    if spec.fn is None:  # MetricSpec holds a function or a source
        raise ValueError(f"metric {spec.name!r} has neither a function nor a source")
    if "y_pred" not in aux or "y_true" not in aux:
        if own:  # the user's own entry, shadowed
            raise _shadowed(
                spec,
                "which this custom step does not return; its step state's "
                f"own {spec.name!r} cannot be read under a built-in name",
            )
        raise ValueError(
            f"metric {spec.name!r} needs y_true and y_pred: a custom loop's step must return "
            f"a dict step state with a 'y_pred' entry and take (x, y) batches (or keep its "
            f"own 'y_true' entry), or name a scalar of its step state with Loop.metric(name, "
            f"...)"
        )
    if own and spec.fn in _BUILT_IN:  # two values answer to the name: neither is taken
        raise _shadowed(
            spec,
            f"and the step state also holds its own {spec.name!r}: which one to track is ambiguous",
        )
    if aux.get("binary_labels") and spec.fn in CLASSIFYING:
        return spec.fn(aux["y_true"], aux["y_pred"], binary=True)
    if spec.fn in _BUILT_IN:
        return _per_example(spec, spec.fn(aux["y_true"], aux["y_pred"]), aux)
    try:
        value = spec.fn(aux["y_true"], aux["y_pred"])
    except CrossBroadcastError:  # fuseloop's own refusal, which names both already
        raise
    except Exception as error:
        error.add_note(_called_with(spec.name, aux["y_true"], aux["y_pred"]))
        raise
    return _per_example(spec, value, aux)


def _called_with(name: str, y_true: Any, y_pred: Any) -> str:
    """A note for an error a metric function raised while traced: its name and what it got
    (a loss's errors are checked on the first batch and say as much; a metric's come from
    inside the step, which names only the step)."""
    got = [
        describe(tree, label) if jax.tree.leaves(tree) else f"{label}={tree!r}"
        for label, tree in (("y_true", y_true), ("y_pred", y_pred))
    ]
    called = f"fuseloop: raised by the metric {name!r}, called as fn(y_true, y_pred)"
    return f"{called}: {', '.join(got)}"


def _per_example(spec: MetricSpec, value: Any, aux: dict[str, Any]) -> Any:
    """`value`, with a warning where a running average would read an array whose leading
    axis cannot hold the batch's examples (nor their elements, flattened) as values per
    example: it counts each of its values as one example (a per-output error reduced over
    the batch reads right so), which a per-class count is not. Said when traced."""
    shape = np.shape(value) if isinstance(value, (jax.Array, np.ndarray)) else ()
    # The trainer's and evaluator's count (y's rows, or x's); the output's rows, which tell
    # the examples where x's leaves hold other rows beside a y without any (a table).
    outputs = batch_size((aux["y_pred"], aux["y_true"]))
    rows = aux.get("examples") or outputs
    averaged = spec.accumulate == "running_average" and len(shape) >= 1
    if averaged and shape[0] != 1 and shape[0] % rows and shape[0] % outputs:  # (1,): a scalar
        warn(
            f"metric {spec.name!r} returned shape {shape} for a batch of {rows} examples, "
            f"not values per example: the running average counts each of its {shape[0]} "
            f"values as one example (per-class counts read as their mean per class and "
            f"batch; accumulate='running_sum' totals them). To track each value, give it a "
            f"metric of its own, e.g. loop.metric(fn_0, name='class_0')",
            UserWarning,
        )
    return value


def _shadowed(spec: MetricSpec, why: str) -> ValueError:
    return ValueError(
        f"metric {spec.name!r} is the built-in metric of (y_true, y_pred), {why}. Rename "
        f"that entry (e.g. 'train_{spec.name}') and attach Loop.metric('train_{spec.name}', "
        f"name={spec.name!r}) to keep the key"
    )


def _scalar_entry(spec: MetricSpec, value: Any) -> Any:
    """`value`, the step state's entry a metric reads, if it is a scalar (checked when the
    step is traced): an array would be averaged over its elements without a word."""
    is_key = hasattr(value, "dtype") and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    if is_key or not (hasattr(value, "shape") or isinstance(value, (bool, int, float))):
        what = "a PRNG key" if is_key else f"a {type(value).__name__}"
        raise ValueError(
            f"metric {spec.name!r} reads step_state[{spec.source!r}], which is {what}, not "
            f"a scalar array; Loop.metric(name) tracks a scalar entry of the step state: keep "
            f"each value to track as an entry of its own (e.g. 'd_loss' and 'g_loss' rather "
            f"than a dict of them)"
        )
    shape = tuple(getattr(value, "shape", ()))
    if shape and int(np.prod(shape)) != 1:
        raise ValueError(
            f"metric {spec.name!r} reads step_state[{spec.source!r}], which has shape "
            f"{shape}, not a scalar; keep the scalar to track in the step state (e.g. its "
            f"mean), or pass a callable(y_true, y_pred) metric for per-example values"
        )
    return value
