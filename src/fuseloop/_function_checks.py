"""What a plain `(init_fn, apply_fn)` pair may hide from its adapter (`_functions.py`): a
state beside the params, a signature that names nothing after x, a train flag under a
name fuseloop does not pass, a state returned beside the output while training. Each is
refused or warned of, naming the fix: as it is, the model would train in its default
mode or lose what it returns, with no word."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ._data_flow import draws
from ._linen import TRAIN_FLAGS, ModelConventionError, ModelModeError
from ._warn import warn

__all__ = [
    "hidden_flags",
    "refuse_hidden_flags",
    "refuse_returned_state",
    "refuse_separate_state",
    "required",
    "warn_unread_signature",
]

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def required(parameter: Any) -> bool:
    """Whether a signature's `parameter` (None: absent) has no default."""
    return parameter is not None and parameter.default is inspect.Parameter.empty


def refuse_separate_state(parameters: Any, apply_fn: Any, rng_names: tuple[str, ...]) -> None:
    """An apply function taking a state beside its params (haiku's
    `hk.transform_with_state`: `apply(params, state, rng, x) -> (out, state)`, or a
    function of the user's own `apply(params, state, x, ...)`): this adapter has no place
    for a state that each step updates (BatchNorm's statistics). Not an input named `state`
    (an agent's observation): haiku's own apply, `state, rng, x`, or `state` followed by
    another input it requires (x), which `apply(params, x)` would not fill anyway."""
    names, values = list(parameters), list(parameters.values())
    haikus = (getattr(apply_fn, "__module__", None) or "").startswith("haiku")
    haiku_order = names[2:3] == ["rng"] and _x_at(values, 3)  # (params, state, rng, x)
    takes_x = names[2:3] in _X_NAMES and _required_input(values[2], rng_names)  # (params, state, x)
    if names[1:2] == ["state"] and (haikus or haiku_order or takes_x):
        raise ModelConventionError(
            f"model: apply_fn reads as ({', '.join(names[:4])}) -> (out, state), taking a "
            f"state beside its params (as haiku's hk.transform_with_state): fuseloop's "
            f"adapter for an (init, apply) pair passes params alone and has no place for a "
            f"state each step updates (BatchNorm's statistics). Use hk.transform where the "
            f"model keeps no state, or write the step with fl.loop(step_fn), carrying the "
            f"state in the step state (where `state` is your input, rename that parameter)"
        )


# The names an input after `state` goes by where `state` is a model's state beside its
# params (`apply(params, state, x)`); an agent's `(params, state, action)` is not one.
_X_NAMES = (["x"], ["inputs"], ["input"], ["batch"], ["features"])


def _x_at(values: list[Any], index: int) -> bool:
    """Whether the signature's parameter at `index` is a required positional input."""
    given = values[index : index + 1]
    return bool(given) and given[0].kind == given[0].POSITIONAL_OR_KEYWORD and required(given[0])


def _required_input(parameter: Any, rng_names: tuple[str, ...]) -> bool:
    """A positional parameter without a default that is neither a flag nor a key."""
    positional = (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    known = parameter.name in TRAIN_FLAGS or parameter.name in rng_names
    return parameter.kind in positional and required(parameter) and not known


def warn_unread_signature(parameters: Any) -> None:
    """An apply function whose signature names nothing a flag or a key could go by:
    `(*args, **kwargs)` (a decorator without functools.wraps), or `(params, x, *args,
    **kwargs)` (a wrapper passing the rest on). A train flag or a key it takes cannot be
    seen, so it would get neither, training in its default mode."""
    values = list(parameters.values())
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in values[:2]):
        shown = "names no x (it takes *args), as a wrapper without functools.wraps shows it"
    elif any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in values[2:]) and all(
        p.kind in _VARIADIC for p in values[2:]
    ):
        shown = "names nothing after x (it passes *args on)"
    else:
        return
    warn(
        f"model: apply_fn's signature {shown}: fuseloop cannot see a train flag or a key "
        f"parameter there, so it passes neither and the model trains and evaluates in its "
        f"default mode. Decorate the wrapper with functools.wraps(apply_fn), or name the "
        f"parameters (lambda params, x, train, rng=None: wrapped(params, x, train, rng=rng))",
        UserWarning,
    )


def hidden_flags(parameters: Any, passed: Mapping[str, Any]) -> dict[str, bool]:
    """Each parameter after params and x with a bool default that fuseloop passes no value
    to (none of `passed`, the flags and the key it fills), with that default: a train
    flag of a name fuseloop does not know (`is_train`, `use_dropout`) keeps its default."""
    return {
        p.name: p.default
        for p in list(parameters.values())[2:]
        if isinstance(p.default, bool) and p.name not in passed and p.kind != p.POSITIONAL_ONLY
    }


def refuse_hidden_flags(
    call: Callable[[Any, dict[str, bool]], Any],
    flags: dict[str, bool],
    rng: Any,
    key: tuple[str, bool],
) -> None:
    """A ModelModeError where the training call draws nothing from the key it is given
    while one of `flags` (at their defaults, `hidden_flags`), flipped, makes it draw: a
    train flag under another name, at whose default the model would train with its
    dropout or noise off. A call that draws at its defaults already uses its key, and a
    flag that adds draws then is an option (`extra_noise=False`), not judged. `call(rng,
    extra)` is the training call with the keyword arguments `extra` added; `key`: the
    name apply_fn takes its key by, and whether it comes before x (haiku's order)."""
    if not flags or _draws_of(call, {}, rng):
        return
    for name, default in flags.items():
        try:
            flipped = _draws_of(call, {name: not default}, rng)
        except Exception:  # noqa: BLE001 - flipped, it needs more than fuseloop gives
            continue
        if flipped:
            raise ModelModeError(_hidden_flag(name, default, *key))


def _hidden_flag(name: str, default: bool, key: str, key_first: bool) -> str:
    value = "train" if default is False else "not train"
    if key_first:  # haiku's apply(params, rng, x)
        wrapper = (
            f"lambda params, {key}, x, train=False: apply_fn(params, {key}, x, {name}={value})"
        )
    else:
        wrapper = (
            f"lambda params, x, train=False, {key}=None: apply_fn(params, x, {name}={value}, "
            f"{key}={key})"
        )
    return (
        f"model: apply_fn's parameter {name}={default} draws from the key when it is "
        f"{not default}, so it reads as a train flag, but fuseloop passes a train/eval "
        f"value only to a parameter named {', '.join(TRAIN_FLAGS)}: as it is, training would "
        f"keep {name}={default} (dropout or noise off). Rename it (train: bool = False), or "
        f"wrap apply_fn ({wrapper}); where it is an option to keep at {default} in training, "
        f"bind it: functools.partial(apply_fn, {name}={default})"
    )


def _draws_of(call: Callable[[Any, dict[str, bool]], Any], extra: dict[str, bool], rng: Any) -> int:
    return draws(jax.make_jaxpr(lambda key: call(key, extra))(rng))


def refuse_returned_state(trained: Any, evaluated: Any, params: Any) -> None:
    """A ModelConventionError where the training call returns `(out, state)` and the
    evaluation call `out` alone, the state shaped as a part of the params (BatchNorm's
    statistics under `params["bn"]`): a trainer gives the loss the training output and
    keeps nothing else it returns, so the state would be dropped and its entry in the
    params trained by gradients instead. `trained`, `evaluated`: the outputs' shapes."""
    if not isinstance(trained, (tuple, list)) or len(trained) < 2:
        return
    if _structure(trained[0]) != _structure(evaluated):
        return
    if not any(_shaped_as_part(extra, params) for extra in trained[1:]):
        return
    raise ModelConventionError(
        "model: apply_fn returns (out, state) while training and out alone in evaluation, "
        "the state shaped as a part of its params (BatchNorm's statistics?). A trainer "
        "hands the loss the training output and keeps nothing else the call returns, so "
        "that state would be dropped, and its entry in the params trained by gradients "
        "instead. Write the step with fl.loop(step_fn), carrying the state in the step "
        "state; or, where the second output is meant for the loss (an auxiliary loss), "
        "return the same structure in evaluation"
    )


def _shaped_as_part(extra: Any, params: Any) -> bool:
    """Whether `extra` is shaped as a container in `params` (its structure and its arrays'
    shapes), or is a dict holding some of one's entries, each shaped as it is (`{"bn":
    new}` of params' `"bn"`). A lone array (an auxiliary loss, an attention map) is not."""
    for part in _subtrees(params):
        if _same_shapes(extra, part):
            return True
        some = (
            isinstance(extra, dict)
            and isinstance(part, dict)
            and extra
            and extra.keys() <= part.keys()
        )
        if some and all(_same_shapes(extra[k], part[k]) for k in extra):
            return True
    return False


def _same_shapes(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are containers of one structure whose arrays have one shape."""
    if not isinstance(a, (dict, list, tuple)) or _structure(a) != _structure(b):
        return False
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.shape(x) == np.shape(y) for x, y in pairs)


def _structure(tree: Any) -> Any:
    """`tree`'s pytree structure, compared with `==` (jax's stubs leave the type open)."""
    return jax.tree.structure(tree)


def _subtrees(tree: Any) -> list[Any]:
    """Every dict, list or tuple in `tree`, `tree` itself included (not its arrays)."""
    found = [tree] if isinstance(tree, (dict, list, tuple)) else []
    children = (
        tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    )
    for child in children:
        found.extend(_subtrees(child))
    return found
