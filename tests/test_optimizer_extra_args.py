"""optax transformations that read extra update arguments (the batch's loss as `value`,
`grad`, the loss as `value_fn`) train as a hand-written optax loop passing them does, fused
and unfused; an update asking for something else gets a ValueError naming the fix."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import tree_equal

SPARSE = "sparse_categorical_cross_entropy"
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(64, 4)).astype(np.float32)
Y = _RNG.integers(0, 3, 64).astype(np.int32)
BATCHES = [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 64, 16)]
MODEL = fl.models.mlp([8, 3])
VARIABLES = MODEL.init(jax.random.PRNGKey(0), X[:2])

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "reduce_on_plateau": lambda: optax.chain(
        optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1)
    ),
    "polyak_sgd": optax.polyak_sgd,
    "lbfgs": optax.lbfgs,
}


def _hand_loop(tx: optax.GradientTransformation, epochs: int) -> dict:
    """The loop optax's documentation shows: value, grad and value_fn passed to update."""

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss(p):
            logits = MODEL.apply({"params": p}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        value, grad = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(
            grad, opt_state, params, value=value, grad=grad, value_fn=loss
        )
        return optax.apply_updates(params, updates), opt_state

    params = VARIABLES["params"]
    opt_state = tx.init(params)
    for _ in range(epochs):
        for xb, yb in BATCHES:
            params, opt_state = step(params, opt_state, xb, yb)
    return params


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_extra_args_optimizer_trains_as_the_hand_written_loop(name):
    tx = OPTIMIZERS[name]()
    loop = fl.trainer(MODEL, SPARSE, tx)
    unfused = loop.run(BATCHES, VARIABLES, epochs=2)
    if name != "lbfgs":  # its line search compiles slowly; fusion is the same for all
        fused = loop.run(BATCHES, VARIABLES, epochs=2, fuse=4)
        assert tree_equal(fused.step_state, unfused.step_state)
    expected = _hand_loop(tx, epochs=2)
    assert tree_equal(unfused.params["params"], expected)
    assert not tree_equal(unfused.params, VARIABLES)  # it trained


def _asks_for(extra: str) -> optax.GradientTransformationExtraArgs:
    def update(updates, state, params=None, **extra_args):
        if extra not in extra_args:
            raise TypeError(f"update() missing 1 required keyword-only argument: '{extra}'")
        return updates, state

    return optax.GradientTransformationExtraArgs(lambda params: (), update)


def _takes_only_value() -> optax.GradientTransformationExtraArgs:
    def update(updates, state, params=None, *, value):
        return updates, state

    return optax.GradientTransformationExtraArgs(lambda params: (), update)


def test_an_update_asking_for_other_arguments_names_what_a_trainer_passes():
    with pytest.raises(ValueError, match=r"asks for arguments.*'weights'.*value.*fl\.loop"):
        fl.trainer(MODEL, SPARSE, _asks_for("weights")).run(BATCHES, VARIABLES)
    with pytest.raises(ValueError, match=r"does not take the extra arguments.*\*\*extra_args"):
        fl.trainer(MODEL, SPARSE, _takes_only_value()).run(BATCHES, VARIABLES)
