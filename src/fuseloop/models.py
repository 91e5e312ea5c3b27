"""Model adapters: flax.linen (native), flax.nnx, equinox and plain `(init, apply)` pairs.

Every adapter has `init(rng, x) -> variables` and `apply(variables, x) -> y`, so
`model.apply(state.params, x)` works on what a trainer returns, plus the
`forward(variables, x, *, train, rng) -> (y, updated_model_state | None)` the step uses.

Example:
    >>> import fuseloop as fl, jax, jax.numpy as jnp
    >>> model = fl.models.mlp([16, 3])
    >>> variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 4)))
    >>> model.apply(variables, jnp.zeros((2, 4))).shape
    (2, 3)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import flax.linen as nn
import jax

from ._linen import TRAIN_FLAGS, ModelModeError, linen

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
    if not features or any(not isinstance(f, int) or f < 1 for f in features):
        raise ValueError(f"features={features!r} must be a non-empty list of positive ints")
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not known; accepted values: {', '.join(_ACTIVATIONS)}"
        )
    return MLP(tuple(features), activation)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_Linen = linen  # the adapter every flax.linen module gets


class from_functions:  # noqa: N801 - reads as a constructor
    """Adapts a plain `(init_fn, apply_fn)` pair.

    `init_fn(rng, x) -> params`; `apply_fn(params, x) -> y`. An `apply_fn` with a `train`
    or `rng` keyword receives them.

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
        self.takes_train = _takes(apply_fn, "train")
        self.takes_rng = _takes(apply_fn, "rng")

    def init(self, rng: Any, x: Any) -> Any:
        """`init_fn(rng, x)`: the initial params.

        Example:
            >>> import jax.numpy as jnp
            >>> model = from_functions(lambda rng, x: {"b": jnp.zeros(2)}, lambda p, x: x + p["b"])
            >>> model.init(None, jnp.ones((1, 2)))["b"].shape
            (2,)
        """
        return self.init_fn(rng, x)

    def apply(self, variables: Any, x: Any) -> Any:
        """`apply_fn(variables, x)` in evaluation mode (`train=False` where it is taken).

        Example:
            >>> import jax.numpy as jnp
            >>> model = from_functions(lambda rng, x: 2.0, lambda p, x, train: x * p + train)
            >>> model.apply(2.0, jnp.ones(2)).tolist()
            [2.0, 2.0]
        """
        return self.forward(variables, x, train=False, rng=None)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        """`(apply_fn(variables, x, ...), None)`, passing `train` and `rng` where taken.

        Example:
            >>> import jax.numpy as jnp
            >>> model = from_functions(lambda rng, x: 2.0, lambda p, x, train: x * p + train)
            >>> y, state = model.forward(2.0, jnp.ones(2), train=True, rng=None)
            >>> y.tolist(), state
            ([3.0, 3.0], None)
        """
        kwargs: dict[str, Any] = {}
        if self.takes_train:
            kwargs["train"] = train
        if self.takes_rng:
            kwargs["rng"] = rng
        return self.apply_fn(variables, x, **kwargs), None


class from_nnx:  # noqa: N801
    """Adapts a flax.nnx module.

    Variables are `{"params": ..., "state": ...}` pure dicts (the Param variables, and
    everything else: batch statistics, RNG streams).

    Dropout and BatchNorm switch with `module.train()`/`module.eval()`; the module's own
    RNG streams are part of `"state"`, so they advance with each step and checkpoint.
    Variables are rebuilt from plain arrays inside each traced call, so nnx never sees a
    Variable created at another trace level (inside `grad` or the fused loop).

    Example:
        >>> from flax import nnx
        >>> model = from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
        >>> sorted(model.init(None, None)["params"])
        ['bias', 'kernel']
    """

    def __init__(self, module: Any):
        from flax import nnx

        self._nnx = nnx
        self.graphdef, params, *others = nnx.split(module, nnx.Param, ...)
        (rest,) = others  # the two filters, Param and `...`, split the module in two
        self._templates = (params, rest)
        self._initial = {"params": nnx.to_pure_dict(params), "state": nnx.to_pure_dict(rest)}

    def init(self, rng: Any, x: Any) -> Any:
        """A copy of the module's own variables (nnx initialises at construction).

        Example:
            >>> from flax import nnx
            >>> model = from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
            >>> model.init(None, None)["params"]["kernel"].shape
            (4, 2)
        """
        return jax.tree.map(lambda a: a, self._initial)

    def _rebuild(self, template: Any, pure: Any) -> Any:
        fresh = jax.tree.map(lambda a: a, template)  # new Variables at this trace level
        self._nnx.replace_by_pure_dict(fresh, pure)
        return fresh

    def _run(self, variables: Any, x: Any, train: bool) -> tuple[Any, Any]:
        nnx = self._nnx
        params = self._rebuild(self._templates[0], variables["params"])
        rest = self._rebuild(self._templates[1], variables["state"])
        module = nnx.merge(self.graphdef, params, rest)
        _set_nnx_mode(module, train)
        y = module(x)
        _, _, rest = nnx.split(module, nnx.Param, ...)
        return y, nnx.to_pure_dict(rest)

    def apply(self, variables: Any, x: Any) -> Any:
        """The module's output on `x` in `.eval()` mode.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> model = from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
            >>> model.apply(model.init(None, None), jnp.ones((3, 4))).shape
            (3, 2)
        """
        return self._run(variables, x, train=False)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        """The output and, in training, the module's updated non-Param state.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> model = from_nnx(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
            >>> variables = model.init(None, None)
            >>> y, new = model.forward(variables, jnp.ones((3, 2)), train=True, rng=None)
            >>> new["state"]["mean"].shape
            (2,)
        """
        y, rest = self._run(variables, x, train)
        return y, ({"state": rest} if train else None)


def _set_nnx_mode(module: Any, train: bool) -> None:
    """Sets an nnx module to training or evaluation mode.

    First nnx's own switch (`.train()`/`.eval()`: Dropout's `deterministic`, BatchNorm's
    `use_running_average`), then any of the recognised flag attributes a user's module
    keeps as a plain bool (e.g. `self.training`).
    """
    from flax import nnx

    if hasattr(module, "train") and hasattr(module, "eval"):
        module.train() if train else module.eval()
    for _, sub in nnx.iter_graph(module):
        if not isinstance(sub, nnx.Module):
            continue
        for name, train_value in TRAIN_FLAGS.items():
            if isinstance(getattr(sub, name, None), bool):
                setattr(sub, name, train_value if train else not train_value)


def _equinox_stateful_layers(module: Any) -> list[str]:
    """Paths of equinox layers that keep state in an `eqx.nn.State` (BatchNorm, ...)."""
    import equinox as eqx

    stateful = (eqx.nn.StateIndex,)
    found = []
    leaves = jax.tree_util.tree_flatten_with_path(
        module, is_leaf=lambda node: isinstance(node, stateful + (eqx.nn.BatchNorm,))
    )[0]
    for path, leaf in leaves:
        if isinstance(leaf, eqx.nn.BatchNorm):
            found.append(f"eqx.nn.BatchNorm at model{jax.tree_util.keystr(path)}")
        elif isinstance(leaf, stateful):
            found.append(f"eqx.nn.StateIndex at model{jax.tree_util.keystr(path)}")
    return found


class from_equinox:  # noqa: N801
    """Adapts an equinox module applied per example (vmapped over the batch axis).

    Variables are `{"params": the module's inexact arrays}`; a module whose `__call__`
    takes `key` gets a per-example key in training. Training runs the module with
    `eqx.nn.inference_mode(module, False)` and evaluation with `True`, so Dropout is on only
    while training. Layers with `eqx.nn.State` (BatchNorm) are refused with an error that
    names them.

    Example:
        >>> import equinox as eqx, jax
        >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
        >>> model.apply(model.init(None, None), jax.numpy.ones((3, 4))).shape
        (3, 2)
    """

    def __init__(self, module: Any, batched: bool = False):
        import equinox as eqx

        self._eqx = eqx
        stateful = _equinox_stateful_layers(module)
        if stateful:
            raise ValueError(
                f"model: equinox layers that keep state in an eqx.nn.State are not supported "
                f"({'; '.join(stateful)}): their state would have to be threaded through "
                f"every call. Use a stateless normalization (eqx.nn.LayerNorm, "
                f"eqx.nn.GroupNorm), or write the step yourself with fl.loop(step_fn)"
            )
        self.params, self.static = eqx.partition(module, eqx.is_inexact_array)
        self.batched = batched
        self.takes_key = _takes(type(module).__call__, "key")
        dropouts = [
            path
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                module, is_leaf=lambda node: isinstance(node, eqx.nn.Dropout)
            )[0]
            if isinstance(leaf, eqx.nn.Dropout)
        ]
        if dropouts and not self.takes_key:
            raise ValueError(
                f"model: {type(module).__name__} has eqx.nn.Dropout (at model"
                f"{jax.tree_util.keystr(dropouts[0])}) but its __call__ takes no `key`, so "
                f"Dropout cannot draw a mask while training. Add `key=None` to __call__ and "
                f"pass it on to the Dropout layers"
            )

    def init(self, rng: Any, x: Any) -> Any:
        """`{"params": a copy of the module's inexact arrays}`.

        Example:
            >>> import equinox as eqx, jax
            >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
            >>> model.init(None, None)["params"].weight.shape
            (2, 4)
        """
        return {"params": jax.tree.map(lambda a: a, self.params)}

    def apply(self, variables: Any, x: Any) -> Any:
        """The module's output on the batch `x`, in inference mode.

        Example:
            >>> import equinox as eqx, jax
            >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
            >>> model.apply(model.init(None, None), jax.numpy.ones((5, 4))).shape
            (5, 2)
        """
        return self.forward(variables, x, train=False, rng=None)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        """`(output, None)`; in training a module taking `key` gets one per example.

        Example:
            >>> import equinox as eqx, jax
            >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
            >>> x = jax.numpy.ones((5, 4))
            >>> y, state = model.forward(model.init(None, None), x, train=True, rng=None)
            >>> y.shape, state
            ((5, 2), None)
        """
        module = self._eqx.nn.inference_mode(
            self._eqx.combine(variables["params"], self.static), value=not train
        )
        if self.batched:
            return module(x), None
        if train and self.takes_key and rng is not None:
            keys = jax.random.split(rng, x.shape[0])
            return jax.vmap(lambda xi, k: module(xi, key=k))(x, keys), None
        return jax.vmap(module)(x), None


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
    if isinstance(model, nn.Module):
        return _Linen(model)
    if isinstance(model, tuple) and len(model) == 2 and all(map(callable, model)):
        return from_functions(*model)
    try:
        from flax import nnx

        if isinstance(model, nnx.Module):
            return from_nnx(model)
    except ImportError:  # pragma: no cover - flax always ships nnx here
        pass
    try:
        import equinox as eqx

        if isinstance(model, eqx.Module):
            return from_equinox(model)
    except ImportError:
        pass
    if hasattr(model, "init") and hasattr(model, "apply"):
        return from_functions(model.init, model.apply)
    raise ValueError(
        f"model={model!r} is not a model: pass a flax.linen module, a flax.nnx or equinox "
        f"module, an (init_fn, apply_fn) pair, or any object with .init(rng, x) and "
        f".apply(variables, x)"
    )


class _EvalFlag(nn.Module):
    """Calls `inner` with its train/eval flags set for evaluation (see `trained`)."""

    inner: nn.Module
    flags: tuple[tuple[str, bool], ...]

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self.inner(x, *args, **{**dict(self.flags), **kwargs})


def _flag_defaults_evaluate(adapter: linen) -> bool:
    """Whether calling the module without its flags already evaluates."""
    parameters = inspect.signature(type(adapter.module).__call__).parameters
    return all(
        name in parameters and parameters[name].default is (not value)
        for name, value in adapter.flags.items()
    )


def _trained_linen(adapter: linen, variables: Any) -> Any:
    if _flag_defaults_evaluate(adapter):
        return adapter.module.bind(variables)
    # Nest the variables one level down, under the wrapper's child `inner`.
    nested = {collection: {"inner": tree} for collection, tree in variables.items()}
    flags = tuple(adapter.mode(False).items())
    return _EvalFlag(adapter.module, flags).bind(nested)


def trained(model: Any, state_or_variables: Any) -> Any:
    """The trained model in its own library's form, callable on x in evaluation mode.

    * flax.linen: the module bound to the variables (`bound(x)`); when the module's
      train/eval flag does not default to evaluation, a bound wrapper that passes it.
    * flax.nnx: the module rebuilt with the trained params and state, in `.eval()` mode.
    * equinox: the module with the trained arrays, in inference mode (batched as equinox
      modules are: per example; `jax.vmap` it for a batch).
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
    variables = getattr(state_or_variables, "params", state_or_variables)
    if variables is None:
        raise ValueError("state_or_variables: the State holds no params (step_state is None)")
    adapter = as_model(model)
    if isinstance(adapter, linen):
        return _trained_linen(adapter, dict(variables))
    if isinstance(adapter, from_nnx):
        nnx = adapter._nnx
        params = adapter._rebuild(adapter._templates[0], variables["params"])
        rest = adapter._rebuild(adapter._templates[1], variables["state"])
        module = nnx.merge(adapter.graphdef, params, rest)
        _set_nnx_mode(module, False)
        return module
    if isinstance(adapter, from_equinox):
        eqx = adapter._eqx
        return eqx.nn.inference_mode(eqx.combine(variables["params"], adapter.static))
    return lambda x: adapter.apply(variables, x)
