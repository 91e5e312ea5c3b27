"""The flax.linen adapter: train/eval mode by the module's own `__call__` flag.

Re-exported from `fuseloop.models` (as `fl.models.linen`).
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Collection, Mapping
from typing import Any

import flax
import flax.linen as nn

from ._linen_sows import RECORDING, recording_sows, train_only_sows

__all__ = [
    "TRAIN_FLAGS",
    "NNX_MODE_FLAGS",
    "ModelConventionError",
    "ModelModeError",
    "call_flags",
    "flag_after_x",
    "flag_values",
    "flags_among",
    "linen",
    "parameters_of",
    "positional_through",
    "split_positional",
]


# `__call__` flags that switch a flax.linen module between training and evaluation, and
# the value each takes while training.
TRAIN_FLAGS: dict[str, bool] = {
    "train": True,
    "training": True,
    "is_training": True,
    "deterministic": False,
    "use_running_average": False,
    "inference": False,  # equinox's own name (eqx.nn.Dropout's)
    "update_stats": True,  # flax's SpectralNorm: its power iteration runs while training
}
# The flags an nnx module keeps as bool attributes (`update_stats` is a linen call's only).
NNX_MODE_FLAGS = {name: value for name, value in TRAIN_FLAGS.items() if name != "update_stats"}


class ModelConventionError(ValueError):
    """A model built in a way a trainer cannot train exactly (raised where it is seen,
    naming the fix, never reported as a misfit of the data).

    Example:
        >>> issubclass(ModelConventionError, ValueError)
        True
    """


class ModelModeError(ModelConventionError):
    """A model whose train/eval mode fuseloop cannot set (raised at the first batch).

    Example:
        >>> issubclass(ModelModeError, ValueError)
        True
    """


def parameters_of(fn: Any) -> Any:
    """`fn`'s parameters by name (empty where it has no signature)."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _call_signature(module: Any) -> Any:
    """`module.__call__`'s parameters by name (empty where it has no signature)."""
    return parameters_of(type(module).__call__)


def _call_parameters(module: Any) -> tuple[str, ...]:
    return tuple(_call_signature(module))


def call_flags(module: Any) -> dict[str, bool]:
    """The recognised train/eval flags among `module.__call__`'s arguments, each with the
    value it takes while training."""
    return flags_among(_call_signature(module), f"{type(module).__name__}.__call__")


def flags_among(parameters: Any, owner: str) -> dict[str, bool]:
    """The recognised train/eval flags among a signature's `parameters` (of `owner`, as
    messages name it), each with the value it takes while training. A positional-only one
    cannot be passed by name, as fuseloop passes it: a ValueError naming the fix."""
    flags = {name: value for name, value in TRAIN_FLAGS.items() if name in parameters}
    for name in flags:
        if parameters[name].kind == inspect.Parameter.POSITIONAL_ONLY:
            raise ValueError(
                f"model: {owner} takes its flag {name!r} positional-only (before a '/'), and "
                f"fuseloop passes it by name ({name}=...): make it a keyword argument"
            )
    return flags


def _rng_stream(error: BaseException) -> str | None:
    """The rng stream a flax InvalidRngError names (None: it names none)."""
    found = re.search(r'PRNG for "([^"]+)"', str(error))
    return found.group(1) if found else None


def flag_after_x(
    cls: Any, flags: Mapping[str, Any], defaults: bool = True
) -> tuple[inspect.Parameter, ...]:
    """The parameters of `cls.__call__` after x to pass by position so that its flags go
    by position (`positional_through`); empty: by keyword."""
    after_x = list(inspect.signature(cls.__call__).parameters.values())[2:]
    return positional_through(after_x, flags, flags, defaults)


def positional_through(
    after_x: list[inspect.Parameter],
    passed: Collection[str],
    flags: Collection[str],
    defaults: bool = True,
) -> tuple[inspect.Parameter, ...]:
    """The parameters `after_x` up to the last of `flags`, to pass by position: a function
    lifted by jax.checkpoint, nn.remat or nn.jit with a flag among its `static_argnums`
    counts positions only (by keyword the flag is traced). Each between is one fuseloop
    `passed` (a key) or, with `defaults`, goes as its default: not for a `jax.jit` that
    names its static arguments, which would trace it. Empty where they cannot all go so:
    then by keyword."""
    last = max((i for i, p in enumerate(after_x) if p.name in flags), default=-1)
    through = tuple(after_x[: last + 1])
    for parameter in through:
        if parameter.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return ()
        given = parameter.name in passed
        if not (given or (defaults and parameter.default is not inspect.Parameter.empty)):
            return ()
    return through


def split_positional(
    through: tuple[inspect.Parameter, ...], given: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """`given` keyword arguments as `(positional, keyword)`: those `through` names (or
    their defaults) by position, in order, the rest by keyword."""
    positional = [given.get(p.name, p.default) for p in through]
    names = {p.name for p in through}
    return positional, {k: v for k, v in given.items() if k not in names}


def flag_values(flags: dict[str, bool], train: bool) -> dict[str, bool]:
    """The flag arguments for training (`train=True`) or evaluation."""
    return {name: (value if train else not value) for name, value in flags.items()}


_BOOL_FLAG_FIX = (
    "fuseloop gives the flag train_value while training and its negation when evaluating. "
    "For a flag that takes strings (mode='train'), wrap the module: a Module with "
    "`inner: nn.Module` whose __call__(self, x, train: bool = False) returns "
    "self.inner(x, mode='train' if train else 'eval')"
)


def _takes_str(parameter: inspect.Parameter) -> bool:
    """Whether a `__call__` parameter is declared to take strings (`str`, `Optional[str]`,
    `Literal["train", "eval"]`, or a str default)."""
    annotation = parameter.annotation
    text = annotation if isinstance(annotation, str) else repr(annotation)
    declared = annotation is str or re.search(r"\bstr\b|Literal\[\s*['\"]", text) is not None
    return declared or isinstance(parameter.default, str)


class linen:  # noqa: N801 - reads as a constructor, like the other adapters
    """Adapts a flax.linen module, naming the `__call__` flag that switches train/eval mode.

    Flags named `train`, `training`, `is_training`, `update_stats` (True while training),
    `deterministic`, `use_running_average` or `inference` (False while training) are found
    by themselves; name any other with `train_arg` and give `train_value`, the value it
    takes while training, unless the name is one of those seven. While training the step
    passes the flag, a `dropout` rng and makes the non-`params` collections (e.g.
    `batch_stats`) mutable; evaluation passes the flag's evaluation value. A module without
    a flag is a ValueError at the first batch if it writes its other collections, needs a
    `dropout` rng, or holds a Dropout layer (which its own defaults would leave off while
    training); collections it only reads (a frozen BatchNorm's) are carried unchanged.

    Args:
        module: The flax.linen module.
        train_arg: The name of its train/eval flag (None: find one of the seven).
        train_value: The flag's value while training (None: from the name).

    Example:
        >>> import flax.linen as nn
        >>> class Net(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x, eval_mode: bool = True):
        ...         return nn.Dropout(0.5, deterministic=eval_mode)(nn.Dense(2)(x))
        >>> model = linen(Net(), train_arg="eval_mode", train_value=False)
    """

    def __init__(
        self, module: nn.Module, train_arg: str | None = None, train_value: bool | None = None
    ):
        if not isinstance(module, nn.Module):
            raise ValueError(f"module={module!r} must be a flax.linen Module")
        if train_value is not None and not isinstance(train_value, bool):
            raise ValueError(
                f"train_value={train_value!r} must be True or False: " + _BOOL_FLAG_FIX
            )
        names = _call_parameters(module)
        self.module = module
        if train_arg is None:
            if train_value is not None:
                raise ValueError("train_value needs train_arg: name the flag it is for")
            self.flags = call_flags(module)
            return
        if train_arg not in names and not any(
            p.kind == inspect.Parameter.VAR_KEYWORD
            for p in inspect.signature(type(module).__call__).parameters.values()
        ):
            raise ValueError(
                f"train_arg={train_arg!r} is not an argument of {type(module).__name__}."
                f"__call__ (its arguments: {', '.join(names[1:])})"
            )
        if train_value is None:
            if train_arg not in TRAIN_FLAGS:
                raise ValueError(
                    f"train_value is needed for train_arg={train_arg!r}: say which value the "
                    f"flag takes while training (True or False); it is inferred only for "
                    f"{', '.join(TRAIN_FLAGS)}"
                )
            train_value = TRAIN_FLAGS[train_arg]
        declared = inspect.signature(type(module).__call__).parameters.get(train_arg)
        if declared is not None and _takes_str(declared):
            raise ValueError(
                f"train_arg={train_arg!r} takes a str in {type(module).__name__}.__call__: "
                + _BOOL_FLAG_FIX
            )
        self.flags = {train_arg: train_value}

    @property
    def takes_train(self) -> bool:
        return bool(self.flags)

    def mode(self, train: bool) -> dict[str, bool]:
        """The flag arguments for training (`train=True`) or evaluation."""
        return flag_values(self.flags, train)

    @functools.cached_property
    def _flag_by_position(self) -> tuple[inspect.Parameter, ...]:
        return flag_after_x(type(self.module), self.flags)

    def _flag_args(self, train: bool) -> tuple[list[Any], dict[str, Any]]:
        """The flag for training or evaluation as `(positional, keyword)` arguments."""
        return split_positional(self._flag_by_position, self.mode(train))

    def init(self, rng: Any, x: Any) -> Any:
        try:
            args, flags = self._flag_args(False)  # the flag, not init's options
            return dict(self.module.init(rng, x, *args, **flags))
        except flax.errors.InvalidRngError as error:
            self._refuse_without_flag(error)
            raise

    def apply(self, variables: Any, x: Any, **kwargs: Any) -> Any:
        if any(name in kwargs for name in self.flags):  # the caller's flag wins
            return self.module.apply(variables, x, **kwargs)
        args, flags = self._flag_args(False)
        return self.module.apply(variables, x, *args, **flags, **kwargs)

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        mutable = [k for k in variables if k != "params"]
        if not self.flags:
            # Collections it only reads (a BatchNorm frozen with use_running_average=True,
            # pretrained weights kept apart) are carried as they are; one it writes is
            # refused. Without "params" these are no collections (variables['params']
            # alone?): the model fails on them, and that failure is what the caller explains.
            try:
                if train and mutable and "params" in variables:
                    return self._apply_reading(variables, x, mutable), None
                if train:
                    return self._apply_refusing_dropout(variables, x), None
                return self.module.apply(variables, x), None
            except flax.errors.InvalidRngError as error:
                self._refuse_without_flag(error)
                raise
            except flax.errors.ModifyScopeVariableError as error:
                if mutable and "params" in variables:
                    raise self._no_flag(f"writes its collections {mutable}") from error
                raise
        if not train:
            return self.apply(variables, x), None
        rngs = {"dropout": rng}
        args, flags = self._flag_args(True)  # the flag, not apply's options
        # A sow into a collection init did not make would be dropped (flax's inspection
        # and auxiliary-loss collections are dropped as flax drops them).
        unmade = lambda name: name not in (*mutable, "intermediates", "losses")  # noqa: E731
        with recording_sows(unmade) as sown:
            if mutable:
                y, updates = self.module.apply(
                    variables, x, *args, rngs=rngs, mutable=mutable, **flags
                )
            else:
                y, updates = self.module.apply(variables, x, *args, rngs=rngs, **flags), None
        if sown:
            raise ModelConventionError(train_only_sows(self.module, sorted(set(sown))))
        return y, None if updates is None else dict(updates)

    def _apply_reading(self, variables: Any, x: Any, mutable: list[str]) -> Any:
        """A training forward pass of a module without a flag that has collections besides
        "params": refused where it writes one. A write fails in flax (the collections are
        not mutable here); a write guarded by `is_mutable_collection`, as flax's own
        layers guard theirs, is found by the question it asks, and a `sow` by its call,
        recorded while the step is traced (a lifted transform's copies of unchanged
        collections are no write)."""
        asked: list[str] = []
        # flax's own inspection and auxiliary-loss collections are carried unchanged, as
        # the run start warns.
        counted = lambda name: name in mutable and name not in ("intermediates", "losses")  # noqa: E731
        with RECORDING, recording_sows(counted) as sown:  # trace time only
            original, recorder = nn.Module.is_mutable_collection, threading.get_ident()

            def recording(module: Any, name: str) -> bool:
                if name in mutable and threading.get_ident() == recorder:
                    asked.append(name)
                return bool(original(module, name))

            nn.Module.is_mutable_collection = recording  # type: ignore[method-assign,assignment]
            try:
                y = self._apply_refusing_dropout(variables, x)
            finally:
                nn.Module.is_mutable_collection = original  # type: ignore[method-assign]
        if asked:
            raise self._no_flag(f"writes its collections {sorted(set(asked))}")
        if sown:
            raise self._no_flag_sow(sorted(set(sown)))
        return y

    def _apply_refusing_dropout(self, variables: Any, x: Any) -> Any:
        """A training forward pass of a module without a flag. A Dropout inside would keep
        the mode the module's own defaults give it (off, unless it then asked for a rng),
        so training would silently run without it: refused. Looked at while the step is
        traced, so a compiled step pays nothing."""
        dropouts: list[Any] = []

        def note(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
            # Dropout layers, and attention's own dropout (`dropout_rate`).
            if (isinstance(context.module, nn.Dropout) and context.module.rate) or getattr(
                context.module, "dropout_rate", 0
            ):
                dropouts.append(context.module)
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(note):
            out = self.module.apply(variables, x)
        if dropouts:
            raise self._no_flag("contains Dropout, which would stay off while training")
        return out

    def _refuse_without_flag(self, error: BaseException) -> None:
        """Raises the no-flag ModelModeError for a flax InvalidRngError asking for the
        'dropout' stream (a flag would give it one); returns for another stream, which
        fuseloop never supplies: the caller re-raises `error` (`_model_fit` names it)."""
        if _rng_stream(error) in (None, "dropout"):
            raise self._no_flag("needs a 'dropout' rng") from error

    def _no_flag_sow(self, names: list[str]) -> ModelModeError:
        name = type(self.module).__name__
        return ModelModeError(
            f"model: {name} sows into its collections {names} but has no train flag "
            f"fuseloop recognises ({', '.join(TRAIN_FLAGS)}); such a module is trained with "
            f"its collections fixed, so flax drops every sown value and {names[0]!r} stays "
            f"as init made it. Add a flag (`def __call__(self, x, train: bool = False)`, or "
            f"name yours with fl.models.linen(module, train_arg=...)) and keep one value per "
            f"step (sow(..., init_fn=..., reduce_fn=lambda old, new: new)), or remove the sow"
        )

    def _no_flag(self, need: str) -> ModelModeError:
        name = type(self.module).__name__
        return ModelModeError(
            f"model: {name} {need}, but its __call__ has no flag fuseloop recognises to switch "
            f"between training and evaluation ({', '.join(TRAIN_FLAGS)}), so Dropout and "
            f"BatchNorm could not behave differently in each. Add one, e.g. "
            f"`def __call__(self, x, train: bool = False)` passing deterministic=not train to "
            f"Dropout and use_running_average=not train to BatchNorm, or name yours with "
            f"fl.models.linen(module, train_arg='name', train_value=True or False)"
        )
