"""Model adapters: flax.linen (native), flax.nnx, equinox and plain `(init, apply)` pairs.

Every adapter has `init(rng, x) -> variables` and `apply(variables, x) -> y`, so
`model.apply(state.params, x)` works on what a trainer returns, plus the
`forward(variables, x, *, train, rng) -> (y, updated_model_state | None)` the step uses.

Each adapter lives in a private module of its own (`_linen`, `_nnx`, `_equinox`,
`_functions`); this module gathers them with the MLP, `as_model` and `trained`.

Example:
    >>> import fuseloop as fl, jax, jax.numpy as jnp
    >>> model = fl.models.mlp([16, 3])
    >>> variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 4)))
    >>> model.apply(variables, jnp.zeros((2, 4))).shape
    (2, 3)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import flax.core
import flax.linen as nn

from ._arg_types import is_int
from ._equinox import from_equinox
from ._functions import from_functions
from ._linen import TRAIN_FLAGS, ModelConventionError, ModelModeError, linen
from ._nnx import from_nnx
from ._nnx_checks import refuse_sown_weights
from ._population import refuse_population
from ._trained import trained_form

__all__ = [
    "ModelAdapter",
    "Activation",
    "mlp",
    "MLP",
    "as_model",
    "linen",
    "trained",
    "from_functions",
    "from_nnx",
    "from_equinox",
    "TRAIN_FLAGS",
    "ModelConventionError",
    "ModelModeError",
]

Activation = Literal["relu", "gelu", "tanh", "sigmoid", "silu"]
"""The activations `mlp` accepts by name."""


@runtime_checkable
class ModelAdapter(Protocol):
    """What the step needs of a model; `as_model` returns one for every model it accepts.

    Variables are any pytree of arrays (`{"params": ...}` for flax). `forward` returns the
    output and, in training, the updated model state (batch statistics, RNG streams) or
    None when the model keeps none.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> adapter = as_model(mlp([2]))
        >>> isinstance(adapter, ModelAdapter)
        True
        >>> variables = adapter.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
        >>> y, new_state = adapter.forward(variables, jnp.ones((1, 3)), train=True, rng=None)
        >>> y.shape, new_state
        ((1, 2), None)
    """

    def init(self, rng: Any, x: Any) -> Any:
        """The model's initial variables, for an input batch like `x`."""
        ...

    def apply(self, variables: Any, x: Any) -> Any:
        """The output for a batch `x` in evaluation mode."""
        ...

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        """The output and the updated model state (None when nothing changed)."""
        ...


_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "relu": nn.relu,
    "gelu": nn.gelu,
    "tanh": nn.tanh,
    "sigmoid": nn.sigmoid,
    "silu": nn.silu,
}


class MLP(nn.Module):
    """A multilayer perceptron: Dense layers with an activation between them.

    Inputs with more than two axes are flattened after the batch axis.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> module = MLP((8, 3), activation="tanh")
        >>> variables = module.init(jax.random.PRNGKey(0), jnp.ones((2, 2, 2)))
        >>> module.apply(variables, jnp.ones((2, 2, 2))).shape
        (2, 3)
    """

    features: Sequence[int]
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: Any) -> Any:
        """The output for a batch `x` (batch axis first)."""
        x = x.reshape((x.shape[0], -1))
        act = _ACTIVATIONS[self.activation]
        for i, width in enumerate(self.features):
            x = nn.Dense(width)(x)
            if i < len(self.features) - 1:
                x = act(x)
        return x


def mlp(features: Sequence[int], activation: Activation = "relu") -> MLP:
    """Builds an MLP (a flax.linen module) with the given layer widths.

    Args:
        features: Width of each Dense layer; the last one is the output width.
        activation: One of "relu", "gelu", "tanh", "sigmoid", "silu".

    Returns:
        A flax.linen module.

    Example:
        >>> model = mlp([128, 10])
        >>> model.features, model.activation
        ((128, 10), 'relu')
    """
    if (
        not isinstance(features, Sequence)
        or isinstance(features, str)
        or not features
        or any(not is_int(f) or f < 1 for f in features)
    ):
        positive_int = is_int(features) and features > 0
        example = f"[{features}]" if positive_int else "[128, 10]"
        raise ValueError(
            f"features={features!r} must be a non-empty list of positive ints, one width per "
            f"layer (e.g. fl.models.mlp({example}))"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not known; accepted values: {', '.join(_ACTIVATIONS)}"
        )
    return MLP(tuple(features), activation)


_Linen = linen  # the adapter every flax.linen module gets


def as_model(model: Any) -> ModelAdapter:
    """Returns the adapter for `model`, or raises a ValueError saying what is accepted.

    Example:
        >>> import jax.numpy as jnp
        >>> type(as_model(mlp([2]))).__name__
        'linen'
        >>> type(as_model((lambda rng, x: 1.0, lambda p, x: x * p))).__name__
        'from_functions'
        >>> as_model(3)
        Traceback (most recent call last):
        ...
        ValueError: model=3 is not a model: pass a flax.linen module, ...
    """
    if isinstance(model, (_Linen, from_functions, from_nnx, from_equinox)):
        return model
    adapters = _module_adapters()
    if isinstance(model, type) and issubclass(model, tuple(adapters)):
        raise ValueError(
            f"model={model.__name__} is a module class, not a module: pass an instance, "
            f"e.g. {model.__name__}() (with its constructor's arguments)"
        )
    keras = _is_keras(model)  # under KERAS_NNX_ENABLED a Keras model is an nnx.Module
    for base, adapter in adapters.items():
        if isinstance(model, base) and not keras:
            return adapter(model)
    if isinstance(model, tuple) and len(model) == 2 and all(map(callable, model)):
        return from_functions(*model)
    if hasattr(model, "init") and hasattr(model, "apply") and not keras:
        return from_functions(model.init, model.apply)
    raise ValueError(
        f"model={_short(model)} is not a model: pass a flax.linen module, a flax.nnx or "
        f"equinox module, an (init_fn, apply_fn) pair, or any object with .init(rng, x) and "
        f".apply(variables, x){_pair_hint(model, adapters)}"
    )


def _is_keras(model: Any) -> bool:
    return any(c.__module__.split(".")[0] == "keras" for c in type(model).__mro__)


def _short(value: Any, limit: int = 120) -> str:
    """`value`'s repr, cut to `limit` characters (a module's repr lists every weight)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(type(v).__name__ for v in value) + ")"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _pair_hint(model: Any, adapters: dict[type, Any]) -> str:
    """The fix for a module handed over with its state.

    That is nnx.split's (graphdef, state), or equinox's (model, state) from
    eqx.nn.make_with_state.
    """
    if inspect.isfunction(model) and model.__name__ == "mlp":  # fl.models.mlp, uncalled
        return ". fl.models.mlp makes a model: call it, e.g. fl.models.mlp([64, 10])"
    if _is_keras(model):
        return (
            ". A Keras model is not adapted as is: under KERAS_BACKEND=jax, a built one "
            "without non-trainable variables (BatchNorm's) or dropout trains as the pair "
            "(lambda rng, "
            "x: [v.value for v in model.trainable_variables], lambda p, x: "
            "model.stateless_call(p, [], x)[0]); for others, write the step with fl.loop"
        )
    if not isinstance(model, tuple) or not model:
        return ""
    names = {type(part).__module__.split(".")[0] for part in model}
    if type(model[0]).__module__.startswith("flax.nnx"):  # nnx's GraphDef first
        return (
            ". This looks like nnx.split(module)'s parts: pass the nnx module itself (its "
            "variables are taken from it)"
        )
    if any(isinstance(part, base) for part in model for base in adapters) and "equinox" in names:
        return (
            ". This looks like an equinox (model, state) pair from eqx.nn.make_with_state: "
            "layers that keep an eqx.nn.State (BatchNorm) are not supported; pass a module "
            "without them (eqx.nn.LayerNorm, eqx.nn.GroupNorm), or write the step with fl.loop"
        )
    return ""


def weights_of_module(value: Any, argument: str, model: Any = None) -> Any:
    """`value` as given, or a module's own weights as fuseloop's variables.

    An nnx or equinox module is built with its weights: they are what `state.params` holds
    for it (not what a call sowed, refused). A linen module holds none and is refused,
    naming what to pass, unless bound to them (as `fl.models.trained` returns it). With
    `model`, the adapter the weights are for, an equinox module's fields that are not
    trained must be that model's (they are compiled into its programs).

    Example:
        >>> from flax import nnx
        >>> linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> weights_of_module(linear, "init_state")["params"]["kernel"].shape
        (3, 2)
    """
    for base, adapter in _module_adapters().items():
        if isinstance(value, base):
            adapted = adapter(value)
            if getattr(adapted, "initialised_when_built", None) is None:  # linen
                bound: Any = value  # fl.models.trained's, bound to its weights
                if getattr(bound, "scope", None) is not None:
                    return flax.core.unfreeze(bound.variables)
                raise ValueError(
                    f"{argument}: a flax.linen module ({type(value).__name__}) holds no "
                    f"weights; pass its variables (module.init(key, x)), a State's params "
                    f"(state.params), or the State"
                )
            refuse_sown_weights(value, argument)
            refuse_other_fields = getattr(model, "refuse_other_fields", None)
            if refuse_other_fields is not None:  # an equinox module: fields not trained
                refuse_other_fields(value, argument)
            return adapted.init(None, None)
    return value


def variables_given(value: Any, argument: str, model: Any = None) -> Any:
    """The variables `value` gives: a State's params, or `value` itself.

    An nnx or equinox module among them (a custom loop may keep one as its params) is
    read as its weights (`weights_of_module`).

    Example:
        >>> variables_given({"params": {"w": 1.0}}, "variables")
        {'params': {'w': 1.0}}
    """
    value = weights_of_module(value, argument, model)
    return weights_of_module(getattr(value, "params", value), argument, model)


def without_params(step_state: Any) -> str:
    """A step state that holds no 'params' entry, described for a message.

    Its type and, for a dict, its keys.

    Example:
        >>> without_params({"theta": 1.0})
        "a dict without a 'params' entry (its keys: ['theta'])"
    """
    keys = f" (its keys: {sorted(map(str, step_state))})" if isinstance(step_state, dict) else ""
    return f"a {type(step_state).__name__} without a 'params' entry{keys}"


@functools.cache
def _module_adapters() -> dict[type, Callable[[Any], ModelAdapter]]:
    """Each module base class `as_model` accepts instances of, with its adapter.

    nnx and equinox are included where installed.
    """
    adapters: dict[type, Callable[[Any], ModelAdapter]] = {nn.Module: _Linen}
    try:
        from flax import nnx

        adapters[nnx.Module] = from_nnx
    except ImportError:  # pragma: no cover - flax always ships nnx here
        pass
    try:
        import equinox as eqx

        adapters[eqx.Module] = from_equinox
    except ImportError:
        pass
    return adapters


def trained(model: Any, state_or_variables: Any) -> Any:
    """The trained model in its own library's form, callable on x in evaluation mode.

    * flax.linen: the module bound to the variables (`bound(x)`, `bound.encode(x)`).
    * flax.nnx: the module rebuilt with the trained params and state, in `.eval()` mode.
    * equinox: the module with the trained arrays, in inference mode (batched as equinox
      modules are: per example; `jax.vmap` it for a batch).
    * A module whose `__call__` takes a train/eval flag that does not default to
      evaluation (`train=True`, `inference=False`) is returned as an instance of a
      subclass of its class, named as it is, whose call passes the flag (a flag given
      wins; its other methods are the module's own). A trainer takes an nnx or equinox
      one, alone or inside a larger model, as its own class again; a tree function
      pairing it with the original module fails on the class: pair the original with
      `state.params["params"]` (the trained arrays in the module's own class).
    * An equinox module whose `__call__` requires `key` still takes one (inference mode
      draws nothing from it: any key will do, as `fl.predict` passes `PRNGKey(0)`).
    * `(init, apply)` functions or any `.init`/`.apply` object: `lambda x: apply(vars, x)`.

    Args:
        model: The model given to the trainer.
        state_or_variables: A State from `run` or the variables (`state.params`).

    Example:
        >>> import fuseloop as fl, jax, jax.numpy as jnp
        >>> model = fl.models.mlp([4, 2])
        >>> variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
        >>> fl.models.trained(model, variables)(jnp.zeros((5, 3))).shape
        (5, 2)
    """
    variables = variables_given(state_or_variables, "state_or_variables")
    if variables is None:
        held = (
            "is None"
            if getattr(state_or_variables, "step_state", None) is None
            else "has no 'params'"
        )
        raise ValueError(
            f"state_or_variables: the State's step_state {held}, so it holds no trained "
            f"model: pass the State a trainer's run returned, or the variables"
        )
    refuse_population(
        state_or_variables,
        "state_or_variables",
        " (fl.predict(model, state, x) predicts with every member at once)",
    )
    return trained_form(as_model(model), variables)
