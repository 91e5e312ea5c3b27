"""The benchmark models, their data, and the one training step every JAX system runs.

Every system trains the same flax MLP with `optax.adam(1e-3)` on a sparse categorical
cross-entropy, from the same initial parameters, over the same batches, so the timings
compare loops, not math. Keras and PyTorch build the same layer widths in their own
frameworks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np
import optax

from .. import models

__all__ = ["BenchWorkload", "ModelSpec", "MODELS", "Workload", "count_params"]


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark MLP: `inputs` features in, Dense layers of `features` widths out.

    Example:
        >>> spec = ModelSpec("mlp-3", inputs=4, features=(8, 3))
        >>> spec.params  # 4*8 + 8 + 8*3 + 3
        67
    """

    name: str
    inputs: int
    features: tuple[int, ...]

    @property
    def params(self) -> int:
        """Trainable parameters (weights and biases).

        Example:
            >>> ModelSpec("linear", inputs=2, features=(1,)).params
            3
        """
        widths = (self.inputs,) + self.features
        return sum(a * b + b for a, b in itertools.pairwise(widths))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("mlp-tiny", 24, (32, 10)),  # 1,130 params
        ModelSpec("mlp-small", 784, (32, 10)),  # 25,450 params
        ModelSpec("mlp-large", 784, (1024, 384, 10)),  # 1,201,290 params
    )
}


def count_params(tree: Any) -> int:
    """Number of scalars in a pytree of arrays."""
    return int(sum(np.size(leaf) for leaf in jax.tree.leaves(tree)))


def _sparse_ce(logits: Any, labels: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class BenchWorkload(Protocol):
    """What the benchmarked systems read of a workload (`Workload` and the zoo's)."""

    @property
    def spec(self) -> Any:
        """The model's spec (it has a `name`)."""

    @property
    def batch_size(self) -> int:
        """Examples per batch."""

    @property
    def n_batches(self) -> int:
        """Batches per epoch."""

    @property
    def x(self) -> np.ndarray:
        """The epoch's inputs (host numpy)."""

    @property
    def y(self) -> np.ndarray:
        """The epoch's targets (host numpy)."""

    @property
    def batches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The epoch as `(x, y)` numpy batches."""

    @property
    def module(self) -> Any:
        """The flax module."""

    @property
    def tx(self) -> Any:
        """The optax optimizer."""

    @property
    def variables(self) -> dict[str, Any]:
        """The initial variables as fuseloop's trainer takes them."""

    @property
    def n_params(self) -> int:
        """Trainable parameters."""

    def describe(self) -> dict[str, Any]:
        """The model's figures for the report."""

    def compared(self, variables: Any, /) -> Any:
        """What the agreement guards compare of fuseloop's variables."""

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """The epoch stacked as `(n_batches, batch_size, ...)` arrays."""

    def fresh_state(self) -> tuple[Any, Any]:
        """Fresh device copies of the initial variables and optimizer state."""

    def train_step(self, variables: Any, opt_state: Any, x: Any, y: Any, /) -> tuple[Any, Any, Any]:
        """One step of the shared update: new variables, optimizer state and loss."""

    def keras_model(self, keras: Any, /) -> Any:
        """The same model in Keras 3."""


@dataclass
class Workload:
    """One model's benchmark: data, initial parameters and the shared step.

    Attributes:
        spec: The model.
        batch_size: Examples per batch.
        n_batches: Batches per epoch.
        x, y: The epoch's examples (host numpy); batch `i` is rows `[i*bs, (i+1)*bs)`.
        batches: The epoch as a list of `(x, y)` numpy batches (views of `x`, `y`).
        module: The flax module (`fuseloop.models.mlp`).
        tx: The optimizer, `optax.adam(1e-3)`.
        params: Initial trainable parameters (host numpy), shared by every JAX system.
    """

    spec: ModelSpec
    batch_size: int = 32
    n_batches: int = 100
    seed: int = 0
    x: np.ndarray = field(init=False)
    y: np.ndarray = field(init=False)
    batches: list[tuple[np.ndarray, np.ndarray]] = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        n = self.batch_size * self.n_batches
        self.x = rng.standard_normal((n, self.spec.inputs)).astype(np.float32)
        # Labels from a fixed random projection: a learnable task, so the loss falls.
        projection = rng.standard_normal((self.spec.inputs, self.spec.features[-1]))
        self.y = np.argmax(self.x @ projection, axis=1).astype(np.int32)
        self.batches = [
            (
                self.x[i * self.batch_size : (i + 1) * self.batch_size],
                self.y[i * self.batch_size : (i + 1) * self.batch_size],
            )
            for i in range(self.n_batches)
        ]
        self.module = models.mlp(list(self.spec.features))
        self.tx = optax.adam(1e-3)
        variables = self.module.init(jax.random.PRNGKey(self.seed), self.batches[0][0])
        self.params = jax.tree.map(np.asarray, variables["params"])

    @property
    def variables(self) -> dict[str, Any]:
        """The initial variables as fuseloop's trainer takes them."""
        return {"params": self.params}

    @property
    def n_params(self) -> int:
        return self.spec.params

    def describe(self) -> dict[str, Any]:
        """The model's figures for the report."""
        return {
            "params": self.spec.params,
            "inputs": self.spec.inputs,
            "features": list(self.spec.features),
        }

    def compared(self, variables: Any) -> Any:
        """What the agreement guards compare of fuseloop's variables: the trainable
        parameters, as the floor and the plain loop return them."""
        return variables["params"]

    def keras_model(self, keras: Any) -> Any:
        """The same layer widths in Keras 3."""
        layers: list[Any] = [keras.Input((self.spec.inputs,))]
        for i, width in enumerate(self.spec.features):
            last = i == len(self.spec.features) - 1
            layers.append(keras.layers.Dense(width, activation=None if last else "relu"))
        return keras.Sequential(layers)

    def stacked(self) -> tuple[np.ndarray, np.ndarray]:
        """The epoch stacked on a leading batch axis: `[n_batches, batch_size, ...]`."""
        xs = np.stack([b[0] for b in self.batches])
        ys = np.stack([b[1] for b in self.batches])
        return xs, ys

    def fresh_state(self) -> tuple[Any, Any]:
        """Device copies of the initial params and optimizer state (safe to donate)."""
        params = jax.device_put(self.params)
        return params, self.tx.init(params)

    def loss(self, params: Any, x: Any, y: Any) -> Any:
        return _sparse_ce(self.module.apply({"params": params}, x), y)

    def train_step(self, params: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        """One step: the loss, its gradient, and the Adam update."""
        loss, grads = jax.value_and_grad(self.loss)(params, x, y)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
