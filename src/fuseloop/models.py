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
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax

__all__ = ["mlp", "MLP", "as_model", "from_functions", "from_nnx", "from_equinox"]

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
    """

    features: Sequence[int]
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = x.reshape((x.shape[0], -1))
        act = _ACTIVATIONS[self.activation]
        for i, width in enumerate(self.features):
            x = nn.Dense(width)(x)
            if i < len(self.features) - 1:
                x = act(x)
        return x


def mlp(features: Sequence[int], activation: str = "relu") -> MLP:
    """Builds an MLP (a flax.linen module) with the given layer widths.

    Args:
        features: Width of each Dense layer; the last one is the output width.
        activation: One of "relu", "gelu", "tanh", "sigmoid", "silu".

    Returns:
        A flax.linen module.

    Example:
        >>> model = mlp([128, 10])
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


class _Linen:
    """flax.linen: `train=True`, a dropout rng and mutable non-param collections in training."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.takes_train = _takes(type(module).__call__, "train")

    def init(self, rng: Any, x: Any) -> Any:
        kwargs = {"train": False} if self.takes_train else {}
        return dict(self.module.init(rng, x, **kwargs))

    def apply(self, variables: Any, x: Any, **kwargs: Any) -> Any:
        if self.takes_train:
            kwargs.setdefault("train", False)
        return self.module.apply(variables, x, **kwargs)

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        if not (train and self.takes_train):
            return self.apply(variables, x), None
        mutable = [k for k in variables if k != "params"]
        rngs = {"dropout": rng}
        if mutable:
            y, updates = self.module.apply(variables, x, train=True, rngs=rngs, mutable=mutable)
            return y, dict(updates)
        return self.module.apply(variables, x, train=True, rngs=rngs), None


class from_functions:  # noqa: N801 - reads as a constructor
    """Adapts a plain `(init_fn, apply_fn)` pair.

    `init_fn(rng, x) -> params`; `apply_fn(params, x) -> y`. An `apply_fn` with a `train`
    or `rng` keyword receives them.

    Example:
        >>> import jax.numpy as jnp
        >>> model = from_functions(lambda rng, x: {"w": jnp.zeros((x.shape[1], 2))},
        ...                        lambda p, x: x @ p["w"])
    """

    def __init__(self, init_fn: Callable[..., Any], apply_fn: Callable[..., Any]):
        self.init_fn, self.apply_fn = init_fn, apply_fn
        self.takes_train = _takes(apply_fn, "train")
        self.takes_rng = _takes(apply_fn, "rng")

    def init(self, rng: Any, x: Any) -> Any:
        return self.init_fn(rng, x)

    def apply(self, variables: Any, x: Any) -> Any:
        return self.forward(variables, x, train=False, rng=None)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        kwargs: dict[str, Any] = {}
        if self.takes_train:
            kwargs["train"] = train
        if self.takes_rng:
            kwargs["rng"] = rng
        return self.apply_fn(variables, x, **kwargs), None


class from_nnx:  # noqa: N801
    """Adapts a flax.nnx module: variables are `{"params": ..., "state": ...}` pure dicts
    (the Param variables, and everything else: batch statistics, RNG streams).

    Dropout and BatchNorm switch with `module.train()`/`module.eval()`; the module's own
    RNG streams are part of `"state"`, so they advance with each step and checkpoint.
    Variables are rebuilt from plain arrays inside each traced call, so nnx never sees a
    Variable created at another trace level (inside `grad` or the fused loop).

    Example:
        >>> from flax import nnx
        >>> model = from_nnx(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    """

    def __init__(self, module: Any):
        from flax import nnx

        self._nnx = nnx
        self.graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        self._templates = (params, rest)
        self._initial = {"params": nnx.to_pure_dict(params), "state": nnx.to_pure_dict(rest)}

    def init(self, rng: Any, x: Any) -> Any:
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
        if hasattr(module, "train"):
            module.train() if train else module.eval()
        y = module(x)
        _, _, rest = nnx.split(module, nnx.Param, ...)
        return y, nnx.to_pure_dict(rest)

    def apply(self, variables: Any, x: Any) -> Any:
        return self._run(variables, x, train=False)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        y, rest = self._run(variables, x, train)
        return y, ({"state": rest} if train else None)


class from_equinox:  # noqa: N801
    """Adapts an equinox module applied per example (vmapped over the batch axis).

    Variables are `{"params": the module's inexact arrays}`; a module whose `__call__`
    takes `key` gets a per-example key in training.

    Example:
        >>> import equinox as eqx, jax
        >>> model = from_equinox(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)))
    """

    def __init__(self, module: Any, batched: bool = False):
        import equinox as eqx

        self._eqx = eqx
        self.params, self.static = eqx.partition(module, eqx.is_inexact_array)
        self.batched = batched
        self.takes_key = _takes(type(module).__call__, "key")

    def init(self, rng: Any, x: Any) -> Any:
        return {"params": jax.tree.map(lambda a: a, self.params)}

    def apply(self, variables: Any, x: Any) -> Any:
        return self.forward(variables, x, train=False, rng=None)[0]

    def forward(self, variables: Any, x: Any, *, train: bool, rng: Any) -> tuple[Any, Any]:
        module = self._eqx.combine(variables["params"], self.static)
        if self.batched:
            return module(x), None
        if train and self.takes_key and rng is not None:
            keys = jax.random.split(rng, x.shape[0])
            return jax.vmap(lambda xi, k: module(xi, key=k))(x, keys), None
        return jax.vmap(module)(x), None


def as_model(model: Any) -> Any:
    """Returns the adapter for `model`, or raises a ValueError saying what is accepted."""
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
