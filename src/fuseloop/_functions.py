"""The adapter for a plain `(init_fn, apply_fn)` pair (or any `.init`/`.apply` object).

Re-exported from `fuseloop.models` (as `fl.models.from_functions`).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
from collections.abc import Callable, Collection
from typing import Any

import flax
import flax.linen as nn
import jax

from ._function_checks import (
    hidden_flags,
    refuse_hidden_flags,
    refuse_returned_state,
    refuse_separate_state,
    required,
    warn_unread_signature,
)
from ._linen import (
    ModelConventionError,
    call_flags,
    flag_values,
    flags_among,
    parameters_of,
    positional_through,
    split_positional,
)
from ._object_snapshot import Snapshot
from ._warn import warn

__all__ = ["from_functions", "key_like", "refuse_unpassed_key", "required", "takes_keyword"]

# The names an apply function's PRNG key goes by: flax's and haiku's `rng`, equinox's and
# much of JAX's `key`. A function that takes one of them gets the step's key there (None
# outside training); an unrecognised spelling would silently never see a key.
RNG_NAMES = ("rng", "key", "rng_key", "prng_key", "dropout_rng")


# Spellings that can only mean a key (`dropout_key`, `noise_rng`, flax's dict of streams
# `rngs`, which fuseloop does not make) but are none of RNG_NAMES: such a parameter keeps
# its default, so dropout would stay off. Not names that may mean something else
# (`cache_key`, `random_seed`).
_LOOKS_LIKE_A_KEY = re.compile(r"^rngs$|_(rng|rngs)$|^(dropout|noise|sample|init)_key$")


def _unknown_key_names(parameters: Any) -> None:
    """A parameter of an apply function (past params and x) that reads as a PRNG key under
    a name fuseloop passes no key by: refused where it has no default (the call would
    fail), warned about where it has one (it would never receive a key)."""
    for name, parameter in key_like(parameters, 2, RNG_NAMES):
        passed = (
            "rngs=None if rng is None else {'dropout': rng}" if name == "rngs" else f"{name}=rng"
        )
        refuse_unpassed_key(
            parameter,
            f"model: apply_fn's parameter {name!r} reads as a PRNG key, but fuseloop passes "
            f"the step's key (while training; None in evaluation) only to a parameter named "
            f"{', '.join(RNG_NAMES)}: rename it to one of those, or wrap apply_fn (lambda p, "
            f"x, rng=None: apply_fn(p, x, {passed}))",
        )


def _flags_at(
    fn: Any, parameters: Any, index: int, passed: Collection[str], flags: Collection[str]
) -> tuple[inspect.Parameter, ...]:
    """The parameters of `fn`'s signature (`parameters`) from position `index` through its
    last flag, to pass by position (`positional_through`), where the callable itself (not
    the function a `functools.wraps` wrapper names) takes that many positional arguments;
    empty: by keyword."""
    # A jax.jit (it has `.lower`) would trace a default given by position.
    defaults = not hasattr(fn, "lower")
    through = positional_through(list(parameters.values())[index:], passed, flags, defaults)
    if not through:
        return ()
    try:  # a wrapper `(params, x, **kw)` takes the flag by name only
        outer = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in outer)
    takes = takes or sum(p.kind in positional for p in outer) >= index + len(through)
    return through if takes else ()


def key_like(parameters: Any, skip: int, passed: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The parameters past the first `skip` whose names read as a PRNG key (one of
    RNG_NAMES, or a spelling only a key has) but are none of `passed`, the names the
    adapter passes a key by."""
    return [
        (name, parameter)
        for name, parameter in list(parameters.items())[skip:]
        if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
        and name not in passed
        and (name in RNG_NAMES or _LOOKS_LIKE_A_KEY.search(name))
    ]


def refuse_unpassed_key(parameter: Any, said: str) -> None:
    """Refuses a key parameter fuseloop never fills where it has no default (the call
    would fail), warns where it has one (it keeps it: dropout or noise off)."""
    if required(parameter):
        raise ValueError(said)
    warn(f"{said}; as it is, it keeps its default (dropout or noise off)", UserWarning)


def _made_by_jax(fn: Any) -> bool:
    """A JAX transformation's wrapper: a compiled function (`jax.jit`), or a function
    JAX defines (`jax.checkpoint`'s functools.wraps wrapper)."""
    if type(fn).__module__.split(".")[0] in ("jax", "jaxlib"):
        return True
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(_JAX_DIR)


_JAX_DIR = os.path.dirname(jax.__file__) + os.sep


def _bound_linen_module(apply_fn: Any) -> nn.Module | None:
    """The flax.linen module whose own `apply` `apply_fn` is (`module.apply`, also under
    JAX's transformations, `jax.jit`, or a `functools.partial` binding no `method` but
    `__call__`), else None. A user's own wrapper may pass the flag itself: it is not
    looked through."""
    for _ in range(8):  # a few layers of wrapping
        module = getattr(apply_fn, "__self__", None)
        if isinstance(module, nn.Module):
            return module if getattr(apply_fn, "__func__", None) is nn.Module.apply else None
        if isinstance(apply_fn, functools.partial):
            method = apply_fn.keywords.get("method")
            called = method in (None, "__call__") or getattr(method, "__name__", "") == "__call__"
            apply_fn = apply_fn.func if called else None
        elif _made_by_jax(apply_fn):
            apply_fn = getattr(apply_fn, "__wrapped__", None)
        else:
            return None
    return None


def _pass_the_module(module: nn.Module, why: str) -> ModelConventionError:
    name = type(module).__name__
    return ModelConventionError(
        f"model: apply_fn is {name}.apply, a flax.linen module's own apply, {why}. Pass "
        f"the module itself (fl.trainer({name}(...), ...)): fuseloop adapts a linen module, "
        f"passing its flag, a 'dropout' rng and its mutable collections while training"
    )


def _refuse_flagged_linen(apply_fn: Any) -> None:
    """`from_functions(module.init, module.apply)` of a linen module with a train flag:
    the pair hides the flag (`apply(variables, *args, **kwargs)`), so every step would run
    the module with the flag's default, evaluation mode (dropout off, BatchNorm frozen)."""
    module = _bound_linen_module(apply_fn)
    if module is None:
        return
    flags = call_flags(module)
    if flags:
        flag = next(iter(flags))
        raise _pass_the_module(
            module,
            f"through which fuseloop cannot see its __call__'s flag {flag!r}: every "
            f"training step would run it with the flag's default (dropout off, BatchNorm "
            f"in evaluation mode)",
        )


def _plain_owner(apply_fn: Any) -> Any:
    """The plain object whose method `apply_fn` is, if any: its attributes may change
    between runs. Modules of flax and equinox are not: they are immutable, or checked on
    their own."""
    owner = getattr(apply_fn, "__self__", None)
    fields = hasattr(owner, "__dict__") or hasattr(type(owner), "__slots__")
    if owner is None or isinstance(owner, type) or not fields:
        return None
    return None if _not_plain(owner) else owner


def _not_plain(owner: Any) -> bool:
    """Whether `owner` is no plain model: a flax or equinox module (immutable, or checked
    by its own adapter) or one of fuseloop's adapters (a `forward` of fuseloop's own)."""
    modules = [
        nn.Module,
        *(sys.modules[m].Module for m in ("flax.nnx", "equinox") if m in sys.modules),
    ]
    ours = type(owner).__module__.startswith("fuseloop.") and hasattr(owner, "forward")
    return ours or isinstance(owner, tuple(modules))


def takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn`'s signature has a parameter called `name` (False when it has none)."""
    return name in parameters_of(fn)


class from_functions:  # noqa: N801 - reads as a constructor
    """Adapts a plain `(init_fn, apply_fn)` pair.

    `init_fn(rng, x) -> params`; `apply_fn(params, x) -> y`. An `apply_fn` with a key
    parameter (`rng`, or equinox's `key`, `rng_key`, `prng_key`, `dropout_rng`) receives
    the step's key there, None outside training (haiku's order, `apply_fn(params, rng, x)`,
    is recognised by its second parameter's name), and one with a train/eval flag
    (`train`, `training`, `is_training`, `deterministic`, ...: `fl.models.TRAIN_FLAGS`)
    receives its value. A trainer trains every params leaf, so each must be floating
    point; params with a "params" entry beside others are refused (only that entry would
    train, flax's convention, and the others would never change).

    Example:
        >>> import jax.numpy as jnp
        >>> model = from_functions(lambda rng, x: {"w": jnp.ones((x.shape[1], 2))},
        ...                        lambda p, x: x @ p["w"])
        >>> variables = model.init(None, jnp.ones((1, 3)))
        >>> model.apply(variables, jnp.ones((1, 3))).tolist()
        [[3.0, 3.0]]
    """

    def __init__(self, init_fn: Callable[..., Any], apply_fn: Callable[..., Any]):
        self.init_fn, self.apply_fn = init_fn, apply_fn
        _refuse_flagged_linen(apply_fn)
        parameters = parameters_of(apply_fn)
        refuse_separate_state(parameters, apply_fn, RNG_NAMES)
        self.flags = flags_among(parameters, "apply_fn")
        # A flag init_fn requires (haiku's `f(x, is_training)`) gets its evaluation value.
        taken = parameters_of(init_fn)
        needed = {n: v for n, v in self.flags.items() if required(taken.get(n))}
        self.init_flags = flag_values(needed, train=False)
        self.init_by_position = _flags_at(init_fn, taken, 2, needed, needed)  # as apply's
        self.rng_name = next((name for name in parameters if name in RNG_NAMES), None)
        if self.rng_name is None and _bound_linen_module(apply_fn) is None:  # its own rngs
            _unknown_key_names(parameters)
            warn_unread_signature(parameters)
        # haiku's transformed apply: `apply(params, rng, *args)`.
        self.rng_second = self.rng_name is not None and list(parameters)[1:2] == [self.rng_name]
        passed = {*self.flags, *([self.rng_name] if self.rng_name else [])}
        after_x = 3 if self.rng_second else 2
        self.by_position = _flags_at(apply_fn, parameters, after_x, passed, self.flags)
        # Flags of other names (`is_train`), checked at the first training call of a
        # function with a key and no flag fuseloop passes (where it has one, other bools
        # are options); not one passed by position with its default (`positional_through`).
        bound = apply_fn.keywords if isinstance(apply_fn, functools.partial) else {}
        named = {*passed, *(p.name for p in self.by_position), *bound}
        asked = self.rng_name is not None and not self.flags
        self.hidden = hidden_flags(parameters, dict.fromkeys(named)) if asked else {}
        self._training_checked = False
        self._owner = _plain_owner(apply_fn)

    def snapshot(self) -> Snapshot | None:
        """The plain object `apply_fn` is a method of, as it is now (None: no such object):
        a loop notes it as each trace of its programs leaves it (`Programs.counted`), with
        what the object's own `init` and `apply` set while traced (a shape noted, a cached
        part)."""
        return None if self._owner is None else Snapshot(self._owner)

    def check_unchanged(self, seen: Snapshot | None) -> None:
        """Raises a ValueError where the plain object `apply_fn` is a method of changed
        since `seen` (what a loop's programs traced: None, nothing yet), reassigned or in
        place (`model.scale = 10.0`, `model.cfg["scale"] = 10.0`, or on its class): those
        programs read the old values. A run checks against its loop's own snapshot (a new
        loop traces anew), `fl.predict` builds a new program instead.

        Example:
            >>> class Scaled:
            ...     scale = 1.0
            ...     def init(self, rng, x): return {}
            ...     def apply(self, params, x): return x * self.scale
            >>> obj = Scaled()
            >>> model = from_functions(obj.init, obj.apply)
            >>> seen = model.snapshot()  # as a loop's trace notes it
            >>> obj.scale = 10.0
            >>> model.check_unchanged(seen)
            Traceback (most recent call last):
            ...
            ValueError: model: the object whose apply fuseloop runs (Scaled) changed ...
        """
        if self._owner is None or seen is None:
            return
        changed = Snapshot(self._owner).changed(seen)
        if changed:
            name = type(self._owner).__name__
            raise ValueError(
                f"model: the object whose apply fuseloop runs ({name}) changed since the "
                f"loop's last run ({', '.join(changed)} changed): the loop's compiled "
                f"programs read the old values. Build a new loop (fl.trainer(model, ...)) "
                f"after changing the model (an object whose apply changes its own attributes "
                f"while another use traces it, a cache by shape, is refused alike: keep such "
                f"state outside the object)"
            )

    def init(self, rng: Any, x: Any) -> Any:
        """`init_fn(rng, x)`: the initial params.

        Example:
            >>> import jax.numpy as jnp
            >>> model = from_functions(lambda rng, x: {"b": jnp.zeros(2)}, lambda p, x: x + p["b"])
            >>> model.init(None, jnp.ones((1, 2)))["b"].shape
            (2,)
        """
        positional, keyword = split_positional(self.init_by_position, self.init_flags)
        return self.init_fn(rng, x, *positional, **keyword)

    def apply(self, variables: Any, x: Any) -> Any:
        """`apply_fn(variables, x)` in evaluation mode (`train=False`, or the flag it takes).

        Example:
            >>> import jax.numpy as jnp
            >>> model = from_functions(lambda rng, x: 2.0, lambda p, x, train: x * p + train)
            >>> model.apply(2.0, jnp.ones(2)).tolist()
            [2.0, 2.0]
        """
        return self.forward(variables, x, train=False, rng=None)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        """`(apply_fn(variables, x, ...), None)`, passing its train/eval flag and `rng` where
        taken.

        Example:
            >>> import jax.numpy as jnp
            >>> model = from_functions(lambda rng, x: 2.0, lambda p, x, train: x * p + train)
            >>> y, state = model.forward(2.0, jnp.ones(2), train=True, rng=None)
            >>> y.tolist(), state
            ([3.0, 3.0], None)
        """
        try:
            return self._call(variables, x, train=train, rng=rng)
        except flax.errors.InvalidRngError as error:
            module = _bound_linen_module(self.apply_fn)
            if module is None:
                raise
            raise _pass_the_module(module, "to which fuseloop cannot pass an rng") from error

    def _call(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        out = self._apply(variables, x, train, rng, {})
        if train and not self._training_checked:
            self._check_training(variables, x, rng, out)
            self._training_checked = True
        return out, None

    def _apply(self, variables: Any, x: Any, train: bool, rng: Any, extra: dict[str, Any]) -> Any:
        """`apply_fn` on `variables` and `x` in `train`'s mode, keywords `extra` added."""
        kwargs: dict[str, Any] = {**flag_values(self.flags, train), **extra}
        leading = (variables, rng, x) if self.rng_second else (variables, x)
        if self.rng_name is not None and not self.rng_second:
            kwargs[self.rng_name] = rng
        # Flags go by position where they can: jax.checkpoint's static_argnums (as
        # nn.remat's) count positions, and by keyword a flag would be traced.
        after_x, kwargs = split_positional(self.by_position, kwargs)
        return self.apply_fn(*leading, *after_x, **kwargs)

    def _check_training(self, variables: Any, x: Any, rng: Any, out: Any) -> None:
        """At the first training call: a train flag of another name left at its default
        (`refuse_hidden_flags`), a state returned beside the output (`refuse_returned_state`).
        Each traces the call again, abstractly; a variant the function cannot run (a flag
        flipped that needs more) is not judged."""
        if self.hidden and rng is not None:

            def call(key: Any, extra: dict[str, bool]) -> Any:
                return self._apply(variables, x, True, key, extra)

            key = (self.rng_name or "rng", self.rng_second)
            refuse_hidden_flags(call, self.hidden, rng, key)
        if self.flags and isinstance(out, (tuple, list)):
            try:
                evaluated = jax.eval_shape(
                    lambda v, b: self._apply(v, b, False, None, {}), variables, x
                )
            except Exception:  # noqa: BLE001 - evaluation's own failure is met where it runs
                return
            refuse_returned_state(out, evaluated, variables)
