"""`fl.models.trained`'s forms: a trained model in its own library's form, callable on x
in evaluation mode.

A model whose `__call__` takes a train/eval flag (`fl.models.TRAIN_FLAGS`) that does not
default to evaluation is given it through a subclass of the module's own class whose
`__call__` passes the flag (`_subclass`), so the result keeps the module's attributes,
fields and other methods, a linen module its variables' paths, and an nnx module its
state paths (`nnx.update(module, nnx.state(trained))` writes the weights
back). A flag passed in a call wins, by keyword or by position, and so does the library's
own switch to training mode (nnx's `.train()`, equinox's `inference_mode(m, False)`: for
Monte Carlo dropout), which leaves the call's own defaults. An nnx or equinox one
pickles as the module's own class and is made an evaluating one again when loaded (a
bound linen module does not pickle); the equinox adapter
takes it as the module's own class (`_equinox.plain_module`), whose pytree a State holds.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn

from ._equinox import from_equinox, plain_module
from ._linen import flag_after_x, flag_values, linen, split_positional
from ._mode_switch import switched_to_training
from ._nnx import from_nnx, set_nnx_mode
from ._variables_diff import first_difference, is_nnx_state

__all__ = ["trained_form"]


def trained_form(adapter: Any, variables: Any) -> Any:
    """`adapter`'s model (see `fl.models.trained`) holding `variables`, evaluating."""
    _require_collections(adapter, variables)
    if isinstance(adapter, linen):
        return _trained_linen(adapter, dict(variables))
    if isinstance(adapter, from_nnx):
        nnx = adapter._nnx
        params = adapter._rebuild(adapter._templates[0], variables["params"], "params")
        rest = adapter._rebuild(adapter._templates[1], variables["state"], "state")
        module = nnx.merge(adapter.graphdef, params, rest)
        set_nnx_mode(module, False)
        return _evaluating(module, flag_values(adapter.flags, False))
    if isinstance(adapter, from_equinox):
        _require_own_shapes(adapter, variables)
        eqx = adapter._eqx
        module = eqx.nn.inference_mode(eqx.combine(variables["params"], adapter.static))
        return _evaluating(module, flag_values(adapter.flags, False))
    return lambda x: adapter.apply(variables, x)


def _unbound(call: Any, flags: Any, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`kwargs` with each of `flags` that the call's arguments (positional ones too, after
    `self`) do not already give."""
    given = inspect.signature(call).bind_partial(None, *args, **kwargs).arguments
    return {**{name: value for name, value in flags if name not in given}, **kwargs}


def _defaults_evaluate(cls: Any, evaluating: dict[str, bool]) -> bool:
    """Whether calling an instance of `cls` without its flags already evaluates."""
    parameters = inspect.signature(cls.__call__).parameters
    return all(
        name in parameters and parameters[name].default is value
        for name, value in evaluating.items()
    )


def _trained_linen(adapter: linen, variables: Any) -> Any:
    evaluating = adapter.mode(False)
    module = adapter.module
    if not _defaults_evaluate(type(module), evaluating):
        # A clone of the module's class's subclass: its fields, methods and variables'
        # paths are the module's own (bind clones it again, as the subclass).
        module = module.clone(parent=None)
        flags = tuple(evaluating.items())
        object.__setattr__(module, "__class__", _subclass(type(adapter.module), flags, False))
    return module.bind(variables)


def _evaluating(module: Any, evaluating: dict[str, bool]) -> Any:
    """`module` (an nnx or equinox module made for `trained`, no one else's), now an
    instance of a subclass of its class whose `__call__` passes the `evaluating` flags,
    unless its flags default to them."""
    if _defaults_evaluate(type(module), evaluating):
        return module
    # (equinox modules are frozen: the class is set as their own __init__ sets fields)
    object.__setattr__(module, "__class__", _subclass(type(module), tuple(evaluating.items())))
    return module


_SUBCLASSES: dict[tuple[Any, Any], type] = {}


def _subclass(cls: Any, flags: tuple[tuple[str, bool], ...], pickles: bool = True) -> type:
    """`cls` with `__call__` passing `flags`; one class per pair, so that jit caches keyed
    by a module's type (`nnx.jit`, `eqx.filter_jit`) compile once for every trained one.
    `pickles`: pickled as `cls` (nnx and equinox modules; a bound linen module does not
    pickle)."""
    if (cls, flags) not in _SUBCLASSES:
        _SUBCLASSES[cls, flags] = _make_subclass(cls, flags, pickles)
    return _SUBCLASSES[cls, flags]


def _make_subclass(cls: Any, flags: tuple[tuple[str, bool], ...], pickles: bool) -> type:
    call = cls.__call__
    # As the adapters pass them; an nnx or equinox call may be jitted by name (nnx.jit).
    by_position = flag_after_x(cls, dict(flags), defaults=issubclass(cls, nn.Module))

    @functools.wraps(call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        if pickles and switched_to_training(self):  # its call's own defaults decide
            return call(self, *args, **kwargs)
        given = _unbound(call, flags, *args, **kwargs)
        if by_position and len(args) == 1:
            positional, keyword = split_positional(by_position, given)
            return call(self, args[0], *positional, **keyword)
        return call(self, *args, **given)

    def __reduce__(self: Any) -> tuple[Any, ...]:
        # Pickled as the module's own class (the one pickle can find by name), made an
        # evaluating one again when loaded.
        return (_evaluating, (plain_module(self), dict(flags)))

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_fuseloop_base": cls,  # what `_equinox.plain_module` makes of it again
    }
    if pickles:
        namespace["__reduce__"] = __reduce__
    return type(cls.__name__, (cls,), namespace)


_SUBMODULE = re.compile(r"^[A-Z][A-Za-z0-9]*_\d+$")  # flax's own submodule names


def _require_collections(adapter: Any, variables: Any) -> None:
    """Raises where `variables` cannot be a linen, nnx or equinox model's variables.

    They are a dict of collections holding 'params' (and 'state' for nnx), as
    `state.params` is; a linen model's params alone (`variables['params']`, keyed by
    flax's submodule names) are named. A linen module without params passes.
    """
    needed = ("params", "state") if isinstance(adapter, from_nnx) else ("params",)
    if not isinstance(adapter, (linen, from_nnx, from_equinox)):
        return  # (init, apply) functions: their variables are whatever init returns
    if isinstance(variables, Mapping) and all(key in variables for key in needed):
        return
    # A linen module without params has none to hold ({} or its other collections); only
    # submodule names flax gives (Dense_0, ...) in place of collections are refused.
    submodules = isinstance(variables, Mapping) and all(_SUBMODULE.match(str(k)) for k in variables)
    if (
        isinstance(adapter, linen)
        and isinstance(variables, Mapping)
        and not (variables and submodules)
    ):
        return
    what = f"a {type(variables).__name__}"
    if is_nnx_state(variables):
        raise ValueError(
            "state_or_variables: an nnx.State (nnx.state(module), as orbax restores it) is "
            "not the variables fuseloop reads; nnx.update(module, state) puts its weights in "
            "the module itself, which is then the trained model (fl.models.trained makes it "
            "from a run's State, or state.params)"
        )
    if isinstance(variables, Mapping):
        what = f"a dict of {sorted(map(str, variables))[:4]}"
        if isinstance(adapter, linen) and variables:
            what += " (the params alone, variables['params']?)"
    raise ValueError(
        f"state_or_variables: {what} is not the variables of this model, a dict holding "
        f"{' and '.join(repr(k) for k in needed)} as state.params does: pass the State "
        f"from run, or state.params"
    )


def _require_own_shapes(adapter: from_equinox, variables: Any) -> None:
    """Raises where `variables` are not arrays of the equinox module's own shapes (a
    head of another width), which `eqx.combine` fails on with a tree's metadata."""
    difference = first_difference(variables, adapter.init(None, None))
    if difference:
        raise ValueError(
            f"state_or_variables: they are not this model's variables.{difference} Pass "
            f"the State of a run of this model (or its state.params), or build the model "
            f"as the one they were trained with"
        )
