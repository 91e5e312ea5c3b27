"""What to tell a user whose x the model rejects on the first batch (`_model_fit.py` says
that it does not fit; this module, what to do about it), and the describing helpers its
sentences share."""

from __future__ import annotations

import inspect
import keyword
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ._arg_types import prediction_first
from ._epoch_order import abstract_key
from ._functions import from_functions
from ._target_shapes import CrossBroadcastError
from ._variables_diff import first_difference
from .models import ModelConventionError, from_equinox, from_nnx

__all__ = [
    "loss_misfit",
    "refuse_one_class_output",
    "several_targets",
    "describe",
    "first_line",
    "fix_for_x",
    "held",
    "named_shapes",
    "no_params",
    "one_example",
    "not_floating",
    "scope_misuse",
    "unbound_axis",
]

# "__call__() missing 1 required positional argument: 'b'": inputs taken separately.
_SEPARATE_INPUTS = re.compile(r"missing \d+ required positional argument")
_KEYWORD_ONLY = re.compile(r"missing \d+ required keyword-only arguments?: (.+)$", re.MULTILINE)
_DTYPES = re.compile(r"same dtypes?, got|dtype mismatch|incompatible dtypes", re.IGNORECASE)
# flax's BatchNorm(axis_name=...) reduces with a collective over a named axis.
_AXIS_NAME = re.compile(r"unbound axis name: (\w+)")
# flax.linen's errors for a collection written where it is immutable (evaluation), and for a
# parameter the variables lack (a layer made only on the training path).
_IMMUTABLE = re.compile(r'Cannot update variable "(\w+)" in "([^"]*)" because collection "(\w+)"')
_NO_PARAM = re.compile(r'Could not find parameter named "(\w+)" in scope "([^"]*)"')
_NO_COLLECTION = re.compile(r'Tried to access "(\w+)" from collection "(\w+)" in "([^"]*)"')


def _dict_unpacking(x: dict[Any, Any]) -> str:
    """The line that takes a dict x's entries apart (unpacking a dict gives its keys):
    `tokens, mask = x['tokens'], x['mask']`, a key that is no variable's name read into
    input_<i>."""
    names: list[str] = []
    for i, key in enumerate(x):
        usable = isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)
        names.append(key if usable and key not in names else f"input_{i}")
    return f"{', '.join(names)} = {', '.join(f'x[{key!r}]' for key in x)}"


def fix_for_x(x: Any, error: BaseException, model: Any) -> str:
    """The advice for an x the model rejects: its shape, or, where the model wanted more
    arguments, how fuseloop calls it (one x); for an equinox module, how it is applied."""
    if _SEPARATE_INPUTS.search(str(error)):
        given = type(x).__name__ if isinstance(x, (tuple, list, dict)) else "x"
        unpack = _dict_unpacking(x) if isinstance(x, dict) and x else "a, b = x"
        return (
            f"fuseloop calls the model with x as one argument (model(x)), so a model taking "
            f"more arguments gets only the {given}: take one argument and unpack it "
            f"(def __call__(self, x): {unpack}), or give the others defaults"
        )
    keyword = _KEYWORD_ONLY.search(str(error))
    if keyword:
        first = re.findall(r"'(\w+)'", keyword[1])[:1] or ["arg"]
        return (
            f"The model's call requires {keyword[1]}, which fuseloop does not pass: it calls "
            f"the model with x and the train/eval flag it found (fl.models.TRAIN_FLAGS) "
            f"only. Give it a default ({first[0]}=...) or bind it (functools.partial, or a "
            f"wrapper module)"
        )
    if isinstance(model, from_equinox) and not model.batched:
        return (
            "An equinox module is applied to one example at a time (vmapped over the batch "
            "axis): give x the shape one example has after the batch axis, or, for a module "
            "written for a whole batch, pass fl.models.from_equinox(module, batched=True)"
        )
    if _DTYPES.search(str(error)):
        return (
            "Give x the dtype the model computes in (cast the data, e.g. x.astype(np.float32), "
            "or build the model with that dtype)"
        )
    return "Give x the shape the model expects (the batch axis first)"


def unbound_axis(error: BaseException, applying: str) -> ValueError | None:
    """The ValueError for a model that reduces over a named axis (None for other errors):
    x is not its problem, the collective is."""
    axis = _AXIS_NAME.search(str(error))
    if axis is None:
        return None
    return ValueError(
        f"model: it reduces over the named axis {axis.group(1)!r} (as "
        f"nn.BatchNorm(axis_name=...) does), which exists only inside jax.pmap or shard_map: "
        f"{applying} fails with NameError: unbound axis name {axis.group(1)}. x is not the "
        f"problem; fuseloop runs its steps under jit. Leave axis_name out: one device needs "
        f"none, and over several (run(..., mesh=...)) the statistics are computed over the "
        f"whole global batch without it"
    )


def scope_misuse(
    error: BaseException, applying: str, fresh: bool, training: bool
) -> ValueError | None:
    """The ValueError for a linen module that writes a collection fuseloop keeps fixed (any
    when evaluated; `params`, which only the optimizer changes, when training), or (with
    `fresh` variables, made by its init with the train flag off) reads a parameter or a
    collection's variable its init did not make; None for other errors. Neither is x's
    doing."""
    written = _IMMUTABLE.search(str(error))
    if written is not None and training:
        name, scope, collection = written.groups()
        return ValueError(
            f"model: it writes {collection!r} ({scope or '/'}, {name!r}) in its forward "
            f"pass, which fuseloop's step keeps fixed (params change only through the "
            f"optimizer): {applying} fails with flax's ModifyScopeVariableError. x is not "
            f"the problem. Keep values the model updates itself in a collection of their "
            f"own (self.variable('state', ...)), as BatchNorm keeps 'batch_stats'"
        )
    if written is not None:
        name, scope, collection = written.groups()
        return ValueError(
            f"model: it updates {collection!r} ({scope or '/'}, {name!r}) when evaluated, "
            f"where fuseloop lets no collection change (the train flag off): {applying} "
            f"fails with flax's ModifyScopeVariableError. x is not the problem. Tie the "
            f"layer to the flag (nn.BatchNorm(use_running_average=not train)), or update "
            f"{collection!r} only when training"
        )
    if not fresh:
        return None
    missing = _NO_PARAM.search(str(error))
    if missing is not None:
        name, scope, error_name = missing.group(1), missing.group(2), "ScopeParamNotFoundError"
        what, where = f"the parameter {name!r}", "the layer is built"
    elif (missing := _NO_COLLECTION.search(str(error))) is not None:
        name, collection, scope = missing.groups()
        error_name = "ScopeCollectionNotFound"
        what, where = f"{name!r} of the collection {collection!r}", "the variable is made"
    else:
        return None
    return ValueError(
        f"model: it reads {what} in {scope or '/'}, which its init (run by fuseloop with "
        f"the train flag off) did not make: {applying} fails with flax's {error_name}. x "
        f"is not the problem. Where {where} only when training (under `if train:`), make "
        f"it on both paths (leave it unused when not training), or initialise the "
        f"variables yourself in training mode and pass them: run(data, "
        f"module.init({{'params': key, 'dropout': key}}, x, train=True))"
    )


def no_params(adapter: Any) -> ModelConventionError:
    """The error for a trainer's model with no trainable parameter: its loss could never
    change, and a run would report training that did not happen."""
    if isinstance(adapter, from_nnx):
        from flax import nnx

        nodes = nnx.iter_graph(adapter.module)
        kinds = sorted({type(v).__name__ for _, v in nodes if isinstance(v, nnx.Variable)})
        held = f" (it holds {', '.join(kinds)} variables)" if kinds else ""
        fix = (
            f"a trainer trains the module's nnx.Param variables{held}: hold the weights "
            f"to train in nnx.Param, or in a subclass of it"
        )
    else:
        fix = (
            "a trainer trains variables['params'] (flax's convention; a plain "
            "(init_fn, apply_fn) pair's whole params): put the weights to train there"
        )
    return ModelConventionError(f"model: it has no parameters to train; {fix}")


def not_floating(adapter: Any, where: str, dtype: Any) -> ModelConventionError:
    """The error for a trained weight that is not floating point (an integer counter or a
    boolean mask kept among the params): a trainer differentiates every weight it trains,
    and JAX's own error ("grad requires real-valued inputs") names none of them."""
    if isinstance(adapter, from_nnx):
        fix = (
            "Hold it in an nnx.Variable that is not an nnx.Param (a subclass of "
            "nnx.Variable of your own, as nnx.BatchStat is): fuseloop carries those "
            "and trains only nnx.Param"
        )
    elif isinstance(adapter, from_functions):
        fix = "Make it a float, or keep constants out of the params (close over them in apply_fn)"
    else:
        fix = (
            "Keep it out of 'params': make it a variable of another collection "
            "(self.variable('counters', name, init_fn)), which fuseloop carries and does "
            "not train"
        )
    return ModelConventionError(
        f"model: the weight params{where} has dtype {dtype}; a trainer differentiates every "
        f"weight it trains, so each must be floating point. {fix}"
    )


def one_example(inputs: str, first_x: Any, model: Any, variables: Any) -> ValueError | None:
    """The error for x given as one example without the batch's axis (`fl.predict` of one
    window): the variables do not fit x, but fit x with a leading axis of 1. None where
    they would not (or the model cannot tell)."""
    if first_x is None or model is None:
        return None
    one = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1, *s.shape), s.dtype), first_x[1])
    try:
        made = jax.eval_shape(model.init, abstract_key(), one)
    except Exception:  # noqa: BLE001 - a hint only: the caller's error stands
        return None
    if first_difference(variables, made):
        return None
    if inputs != "x":  # a run's batches: y is one example's too
        fix = "batch x and y: fl.data.arrays(np.stack(xs), np.stack(ys), batch_size=32)"
    elif hasattr(first_x[1], "shape"):
        fix = "add it, x[None] (or np.stack(examples) for several)"
    else:
        fix = "add it to each leaf, jax.tree.map(lambda a: a[None], x)"
    return ValueError(
        f"{inputs.removesuffix('x')}{describe(first_x[0], 'x')} does not fit the model "
        f"with the given variables, but would with a leading axis of 1: it looks like one "
        f"example without the batch's axis. {fix[0].upper()}{fix[1:]}"
    )


def first_line(error: BaseException) -> str:
    """`error`'s type and the first line of its message, for a sentence of ours."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0].rstrip('.') if text else ''}"


def describe(tree: Any, name: str) -> str:
    """`tree`'s leaves as "name['key'] of shape (a, b)", joined; "no arrays" for none."""
    parts = [f"{leaf} of shape {shape}" for leaf, shape in named_shapes(tree, name)]
    return ", ".join(parts) if parts else "no arrays"


def named_shapes(tree: Any, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """(prefix + the leaf's path, its shape) for every leaf of `tree`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(prefix + jax.tree_util.keystr(path), tuple(np.shape(leaf))) for path, leaf in flat]


def held(variables: Any) -> str:
    """`variables`' repr, cut to 60 characters."""
    text = repr(variables)
    return text if len(text) <= 60 else text[:57] + "..."


def several_targets(y: Any, loss: Any) -> str:
    """Advice where y holds several targets (a dict or tuple of them) and the loss is the
    user's: one written for one array reads the one it trains on."""
    if isinstance(loss, str) or not isinstance(y, (dict, tuple, list)) or not y:
        return _prediction_first(loss)
    keys = list(y) if isinstance(y, dict) else list(range(len(y)))
    entries = ", ".join(f"y_true[{key!r}]" for key in keys)
    return f"; y holds targets {entries}: does the loss read the one it needs, not all of y?"


def _prediction_first(loss: Any) -> str:
    """Advice where the user's loss names its first parameter for the prediction (optax's
    order, `(logits, labels)`): fuseloop calls `loss(y_true, y_pred)`."""
    try:
        names = list(inspect.signature(loss).parameters)
    except (TypeError, ValueError):
        return ""
    if not prediction_first(names):
        return ""
    first = names[0]
    return (
        f"; the loss's first parameter is {first!r}, but fuseloop calls loss(y_true, y_pred) "
        f"(optax's losses take (logits, labels)): swap them"
    )


def refuse_one_class_output(name: str, y_pred: Any, output: str) -> None:
    """Refuses a categorical cross-entropy over an output of one class on its last axis: a
    softmax over one logit is 1, so the loss is 0 whatever the model outputs (a Keras
    user's binary model under the multi-class loss). A 1-D output is left alone: one
    example's class scores, or a softmax across a batch on purpose (listwise ranking)."""
    if name not in ("categorical_cross_entropy", "sparse_categorical_cross_entropy"):
        return
    shape = tuple(y_pred.shape)
    if len(shape) >= 2 and shape[-1] == 1:
        raise ValueError(
            f"loss {name!r} reads class scores on the output's last axis, and {output} has "
            f"one class there: a softmax over one logit is 1, so the loss is 0 whatever "
            f"the model outputs. For a binary target, use loss='binary_cross_entropy' (one "
            f"logit per example); for several classes, give the last layer one unit per class"
        )


def loss_misfit(error: BaseException, y: Any, y_pred: Any) -> bool:
    """Whether `error`, raised by a custom loss on the first batch, may say y does not fit
    it: jax and numpy report a shape or dtype misfit as a TypeError, ValueError or
    IndexError; a KeyError where y holds a mapping and the output none, of a key a
    mapping at y's top lacks; an AttributeError of a tuple or list where y is one (`y.weight`
    of a plain tuple). Any other (a typo such as `jnp.meen` or `p.meen()`, an assert, a
    KeyError of a key y's top mappings hold: a config's, a RuntimeError) is the loss's
    own, as are jax's tracer errors and a cross broadcast's refusal (their text says the
    fix): each keeps its type, with the shapes in a note."""
    if isinstance(error, (jax.errors.JAXTypeError, jax.errors.JAXIndexError, CrossBroadcastError)):
        return False
    if isinstance(error, (TypeError, ValueError, IndexError)):
        return True
    if isinstance(error, KeyError):  # a key y's top dicts hold: another dict's (a config's)
        missing = error.args[0] if error.args else None
        return _holds_mapping(y) and not _holds_mapping(y_pred) and not _top_has(y, missing)
    if isinstance(error, AttributeError):
        structure = (tuple, list)
        return isinstance(y, structure) and isinstance(getattr(error, "obj", None), structure)
    return False


def _top_has(y: Any, key: Any) -> bool:
    """Whether every mapping at y's top (y, or each item of a tuple or list y) holds `key`:
    a loss reads y's keys there (`y["w"]`, `y[0]["w"]`). False where y's mappings are all
    deeper."""
    items = y if isinstance(y, (tuple, list)) else (y,)
    tops = [item for item in items if isinstance(item, Mapping)]
    try:
        return all(key in top for top in tops) if tops else False
    except TypeError:  # an unhashable key (pandas' KeyError of a list): the loss's own
        return True


def _holds_mapping(tree: Any) -> bool:
    if isinstance(tree, Mapping):
        return True
    return isinstance(tree, (tuple, list)) and any(_holds_mapping(v) for v in tree)


def loss_misfit_error(error: BaseException, name: str, y: Any, output: str, loss: Any) -> Exception:
    """The `ValueError` for a custom loss that `loss_misfit` says y does not fit. A key
    missing where the loss reads it is more often misspelt, or read at the wrong level of
    y, than left out of y: the key is named with every key y holds, not y's shape."""
    if isinstance(error, KeyError) and error.args:
        return ValueError(
            f"data: the loss {name!r} reads a key {error.args[0]!r} where y does not hold "
            f"it: y holds {describe(y, 'y')}. Correct the key or where the loss reads it, "
            f"or give y that entry (where the loss reads it from a dict of its own, that "
            f"dict lacks it)"
        )
    return ValueError(
        f"data: y does not fit the loss {name!r}: with y ({describe(y, 'y')}) and "
        f"{output} it fails with {first_line(error)}. Give y the shape the loss "
        f"expects for this output{several_targets(y, loss)}"
    )
