"""What a trainer or evaluator says of its model at a run's start, on the host, before
anything runs (once per Loop: its program cache keeps the verdict).

* A model that sows a "losses" collection (`_step.warn_sown_losses`).
* A model whose outputs are already probabilities (a final sigmoid or softmax, as a Keras
  model ends) under a built-in cross-entropy, which takes logits as optax's losses do: it
  would apply the sigmoid or softmax a second time. Found by the function that makes the
  output in the model's traced forward pass, or by its values on the first batch (an
  eager forward pass in evaluation mode), which is skipped where a dense or convolutional
  layer makes the output and nothing in the model squashes values (its output is logits).
* A model ending in a sigmoid under "accuracy", "precision" or "recall" reading its one
  output per example as a binary logit: thresholded at 0, every probability counts as
  positive. Found by the traced forward pass alone: an output in (0, 1) is no evidence of
  probabilities there, since a logit can fall there too.
* A schedule-free optimizer (optax.contrib), whose params are its training point.
* Hyperparameters that `optax.inject_hyperparams` holds in the params' bfloat16 or
  float16, where adam's b2=0.999 reads 1.0.

The same forward pass finds the rule the class metrics hold the run's labels to
(`_class_labels.class_label_rule`: rows summing to 1, or 0/1 targets), which the run's
label checks apply to every batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._class_labels import ClassLabels, class_label_rule
from ._metrics import CLASSIFYING
from ._rate_groups import inject_states
from ._step import split_batch, warn_sown_losses
from ._warn import warn

__all__ = ["warn_about_model"]

# The built-in losses that take logits, and the function each applies to them.
_APPLIES = {
    "binary_cross_entropy": "sigmoid",
    "categorical_cross_entropy": "softmax",
    "sparse_categorical_cross_entropy": "softmax",
}
_SPARSE = ("sparse_categorical_cross_entropy",)
_CHECKED = "probabilities checked"
_OPTIMIZER_CHECKED = "optimizer checked"  # schedule-free, narrow hyperparameters
# Operations that pass a value on unchanged but for its layout or precision (a transpose:
# a vmapped `W @ x`, as equinox's Linear under jax.vmap makes it).
_PASSING = frozenset(
    {"reshape", "squeeze", "expand_dims", "transpose", "convert_element_type", "copy", "copy_p"}
)
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")  # where a nested call keeps its jaxpr
# What a dense or convolutional layer ends with: its output is unbounded (logits).
_LAYERS = frozenset({"dot_general", "conv_general_dilated"})
_SQUASHING = frozenset({"exp", "logistic", "tanh", "erf", "erfc"})


def warn_about_model(
    program: Any, step_state: Any, first_batch: Any, verdicts: dict[Any, Any], metrics: Any
) -> ClassLabels | None:
    """The run-start warnings about a model (`step_state`: a solo run's, or a population's
    member 0; `verdicts`: the Loop's cache of checks already made; `metrics`: its
    MetricSpecs). Returns the rule the class metrics hold the run's labels to (None: none),
    from the model's output shape, found once per Loop with the warnings, and the shape of
    the run's labels; they are checked against it by the run's `LabelChecks.classes`."""
    warn_sown_losses(program, step_state)
    if program.kind == "trainer" and _OPTIMIZER_CHECKED not in verdicts:
        verdicts[_OPTIMIZER_CHECKED] = True
        # (a resumed State of another loop's may hold none: the step-state check says so)
        opt_state = step_state.get("opt_state") if isinstance(step_state, dict) else None
        _warn_schedule_free(opt_state)
        _warn_narrow_hyperparams(opt_state)
        _warn_scheduled_masks(opt_state)
    if program.kind not in ("trainer", "evaluator"):
        return None
    # A named sparse loss holds class indices to the outputs' classes already.
    indices = not (isinstance(program.loss, str) and program.loss_name in _SPARSE)
    if _CHECKED in verdicts:  # the rule depends on the labels' shape: a run's own
        reading, shape = verdicts[_CHECKED]
        return class_label_rule(reading, shape, split_batch(first_batch)[1], indices)
    applies = _APPLIES.get(program.loss_name or "") if isinstance(program.loss, str) else None
    classifying = [spec.name for spec in metrics if spec.fn in CLASSIFYING]
    params = step_state.get("params") if isinstance(step_state, dict) else None
    if (applies is None and not classifying) or params is None:
        return None  # (a State of another loop's holds no params: the step-state check says so)
    x, y = split_batch(first_batch)
    final, shape = _final_function(program.model, params, x)
    # A binary cross-entropy makes the class metrics element-wise, as Keras's are.
    reading = () if program.loss_name == "binary_cross_entropy" else tuple(classifying)
    verdicts[_CHECKED] = (reading, shape)
    if applies is not None:
        # A layer's output is logits: only another final operation needs the model run
        # (eagerly, op by op, so costly on a large model) to see what it returns. A final
        # sigmoid or softmax is never logits, whichever one the loss applies.
        if final in ("sigmoid", "softmax") or (
            final != "layer" and _outputs_look_like(program.model, params, x, applies)
        ):
            _warn_loss(program.loss, applies, final, classifying)
    elif final in ("sigmoid", "softmax") and (len(shape) < 2 or shape[-1] == 1):
        _warn_metrics(classifying, final)  # one output per example, read as a binary logit
    return class_label_rule(reading, shape, y, indices)


def _warn_schedule_free(opt_state: Any) -> None:
    """Warns where the optimizer is one of optax's schedule-free ones, whose params are the
    training point, not the point to evaluate."""
    from optax.contrib import ScheduleFreeState

    def is_state(node: Any) -> bool:
        return isinstance(node, ScheduleFreeState)

    if not any(map(is_state, jax.tree.leaves(opt_state, is_leaf=is_state))):
        return
    warn(
        "optimizer: a schedule-free optimizer (optax.contrib) trains params that are its "
        "training point, not the point to evaluate: validate, early_stop(restore_best=True), "
        "fl.predict and fl.models.trained read the training point. The point to evaluate "
        "is optax.contrib.schedule_free_eval_params(state.step_state['opt_state'], trained) "
        "of the params the optimizer updates (for a linen model, trained = "
        "state.params['params']); evaluate it with fl.evaluator(model).run(data, ...)",
        UserWarning,
    )


def _narrow_float(dtype: Any) -> bool:
    """Whether `dtype` is a float narrower than float32; None (a hyperparameter that is no
    array: a weight-decay mask's tree of bools) is not."""
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _warn_scheduled_masks(opt_state: Any) -> None:
    """Warns where `optax.inject_hyperparams` holds a mask that is one bool: it calls a
    function hyperparameter with the step count (a schedule), so a mask written for the
    params (`lambda p: jax.tree.map(lambda x: x.ndim > 1, p)`) gave one answer for all of
    them, and weight decay is on or off everywhere, as in a hand-written optax loop."""
    for node in inject_states(opt_state):
        mask = node.hyperparams.get("mask")
        if isinstance(mask, (bool, np.bool_)) or getattr(mask, "shape", None) == ():
            warn(
                "optimizer: optax.inject_hyperparams calls a function hyperparameter with the "
                "step count, as a schedule, so the mask function it was given returned one "
                "bool for every param (the decay is on or off everywhere). To mask by param, "
                "pass the mask through static_args, e.g. "
                "optax.inject_hyperparams(optax.adamw, static_args=('mask',))(..., mask=fn)",
                UserWarning,
            )
            return


def _warn_narrow_hyperparams(opt_state: Any) -> None:
    """Warns where `optax.inject_hyperparams` holds float hyperparameters narrower than
    float32: it takes the params' dtype, and in bfloat16 adam's b2=0.999 reads 1.0 (the
    loss turns NaN within a few steps, as in optax's own loop)."""
    narrow = {
        name: value
        for node in inject_states(opt_state)
        for name, value in node.hyperparams.items()
        if _narrow_float(getattr(value, "dtype", None))
    }
    if not narrow:
        return
    dtype = jnp.result_type(next(iter(narrow.values()))).name
    with jax.transfer_guard("allow"):  # host read: a few scalars, the library's own, once
        values = ", ".join(f"{k}={float(np.asarray(v, np.float32))!r}" for k, v in narrow.items())
    warn(
        f"optimizer: optax.inject_hyperparams holds its hyperparameters in the params' dtype "
        f"{dtype}, where they round ({values}; adam's b2=0.999 reads 1.0 and its loss turns "
        f"NaN within a few steps). Give the trainer a named optimizer ('sgd', 'adam', "
        f"'adamw': hyperparameters and state in float32), or keep the params in float32 (a "
        f"layer's param_dtype) and compute in {dtype} (its dtype)",
        UserWarning,
    )


# A metric of probabilities, for (B,) or (B, 1) labels against a (B, 1) output alike, in
# place of the built-in one (which keeps the name "accuracy").
_OWN_ACCURACY = (
    ".metric(lambda y, p: (p.reshape(y.shape) > 0.5) == (y > 0.5), name='prob_accuracy') "
    "in place of .metric('accuracy')"
)


def _warn_loss(loss: str, applies: str, final: Any, classifying: Sequence[str]) -> None:
    """Warns of probabilities into a loss that takes logits; `final` names the model's
    own last function where it was found (a softmax under a binary cross-entropy), else
    the loss's own is taken to be it (outputs that look so)."""
    has = final if final in ("sigmoid", "softmax") else applies
    # A binary metric thresholds the output at 0 as a logit; a class's argmax is the
    # same on probabilities (softmax keeps the order), so only sigmoid's metrics suffer.
    binary = applies != "softmax" and bool(classifying)
    listed = ", ".join(repr(name) for name in classifying)
    if (has, applies) == ("softmax", "sigmoid"):  # several labels: no loss of one's own
        other = (
            ". For several labels per example, each label's own sigmoid is its "
            "probability: a softmax makes the labels compete for one"
        )
    elif (has, applies) == ("sigmoid", "softmax"):  # one class per example, or several?
        other = (
            ". For several labels per example (multi-hot targets), keep one logit per label "
            "and train with loss='binary_cross_entropy', which applies each one's sigmoid"
        )
    else:
        own = _OWN_ACCURACY if "accuracy" in classifying else "one that thresholds at 0.5"
        other = (
            f", or pass a loss of your own that takes probabilities"
            f"{f' (and a metric of your own: {own})' if binary else ''}"
        )
    warn(
        f"model: its outputs look like probabilities (a final {has}"
        f"{', each row summing to 1' if has == 'softmax' else ''}), but the built-in "
        f"loss '{loss}' takes logits, as optax's losses do: it applies {applies} itself, so "
        f"the loss would see {applies}({has}(...))"
        f"{f' and {listed} would threshold probabilities as logits' if binary else ''}. "
        f"Remove the model's final {has} (apply jax.nn.{applies} to fl.predict's outputs "
        f"instead){other}",
        UserWarning,
    )


def _warn_metrics(names: Sequence[str], final: str) -> None:
    listed = ", ".join(repr(name) for name in names)
    warn(
        f"model: its output is a probability per example (a final {final}), but the built-in "
        f"metric(s) {listed} read one output per example as a binary logit, thresholded at "
        f"0: every probability would count as a positive prediction. Remove the model's "
        f"final {final} and train with loss='binary_cross_entropy' (it takes logits, as "
        f"optax's losses do; apply jax.nn.sigmoid to fl.predict's outputs), or pass a metric "
        f"of your own: {_OWN_ACCURACY}",
        UserWarning,
    )


def _final_function(model: Any, params: Any, x: Any) -> tuple[str | None, tuple[int, ...]]:
    """ "sigmoid" or "softmax" where the model's traced forward pass (evaluation mode) makes
    its output with that function, "layer" where a dense or convolutional layer makes it in
    a model with no squashing operation (its output is logits), else None (also for several
    outputs, or a model that fails: the run's own checks report that); and the output's
    shape."""
    try:
        closed = jax.make_jaxpr(lambda p, v: model.forward(p, v, train=False, rng=None)[0])(
            params, x
        )
    except Exception:  # noqa: BLE001 - the run's own checks report a model that fails
        return None, ()
    if len(closed.jaxpr.outvars) != 1:
        return None, ()
    output = closed.jaxpr.outvars[0]
    final = _made_by(closed.jaxpr, output)
    if final == "layer" and _squashes(closed.jaxpr):
        # A layer may mix probabilities (softmax(h) @ T, a gated mixture): its outputs are
        # logits for certain only where nothing in the model squashes values into a range.
        final = None
    return final, tuple(getattr(output.aval, "shape", ()))


def _squashes(jaxpr: Any) -> bool:
    """Whether `jaxpr` (or a call, loop or branch inside it) holds an operation that can
    make probabilities (exp, logistic, tanh, erf)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _SQUASHING:
            return True
        for value in eqn.params.values():
            inner = value if isinstance(value, (tuple, list)) else (value,)
            for item in inner:
                item = getattr(item, "jaxpr", item)
                if hasattr(item, "eqns") and _squashes(item):
                    return True
    return False


def _made_by(jaxpr: Any, var: Any) -> str | None:
    """The function ("sigmoid", "softmax") that made `var` in `jaxpr`, or "layer" for a
    dense or convolutional layer's product (with or without its bias added), through
    operations that only reshape or cast and into nested calls (jit, custom_jvp); None if
    none of those."""
    producers = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    while (eqn := _producer(producers, var)) is not None:
        name = eqn.primitive.name
        if name == "logistic":
            return "sigmoid"
        if name in _LAYERS or (name == "add" and any(_layer(producers, v) for v in eqn.invars)):
            return "layer"
        if name == "div" and _made_by_exp(producers, eqn.invars[0]):
            return "softmax"  # exp(x - max) / sum(exp(x - max)), as jax.nn.softmax writes it
        if name in _PASSING:
            var = eqn.invars[0]
            continue
        inner = next((eqn.params[key] for key in _CALLS if key in eqn.params), None)
        if inner is None:
            return None
        inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr, or a Jaxpr
        return _made_by(inner, inner.outvars[eqn.outvars.index(var)])
    return None


def _layer(producers: dict[Any, Any], var: Any) -> bool:
    """Whether a layer's product made `var` (through reshapes and casts): a bias add's
    operand."""
    while (eqn := _producer(producers, var)) is not None and eqn.primitive.name in _PASSING:
        var = eqn.invars[0]
    return eqn is not None and eqn.primitive.name in _LAYERS


def _made_by_exp(producers: dict[Any, Any], var: Any) -> bool:
    eqn = _producer(producers, var)
    return eqn is not None and eqn.primitive.name == "exp"


def _producer(producers: dict[Any, Any], var: Any) -> Any:
    """The operation that made `var`; None for a constant written into the program (a
    jaxpr Literal, `1` in a hand-written `1 / (1 + exp(-h))`, which cannot be hashed)."""
    return None if hasattr(var, "val") else producers.get(var)


def _forward(model: Any, params: Any, x: Any) -> Any:
    """The model's output on `x` (evaluation mode, eagerly), or None if it fails or is not
    one floating array."""
    try:
        output = model.forward(params, x, train=False, rng=None)[0]
    except Exception:  # noqa: BLE001 - the run's own checks report a model that fails
        return None
    if not hasattr(output, "dtype") or not jnp.issubdtype(output.dtype, jnp.floating):
        return None
    return output


def _outputs_look_like(model: Any, params: Any, x: Any, applies: str) -> bool:
    """Whether the model's outputs on the first batch hold what `applies` (sigmoid or
    softmax) returns: values strictly inside (0, 1) (a logit model's outputs at
    initialisation straddle 0), and for softmax rows of at least two classes summing to 1
    within the output's precision."""
    output = _forward(model, params, x)
    if output is None or output.size < 2:
        return False
    values = np.asarray(output, np.float32)
    if not np.all(np.isfinite(values)):
        return False
    inside = bool(np.all((values > 0) & (values < 1)))
    if applies == "sigmoid" or not inside:
        return inside
    if values.ndim < 1 or values.shape[-1] < 2:
        return False
    # A row's sum is off by a few units in the last place of each term (bf16: ~4e-3).
    tolerance = max(1e-3, 4 * values.shape[-1] * float(jnp.finfo(output.dtype).eps))
    return bool(np.all(np.abs(np.sum(values, axis=-1) - 1.0) < tolerance))
