"""Complex-valued models (signal processing, physics) trained with a real loss: the squared
error is a squared distance, a metric is a mean of real numbers, and double-width complex
params get the named optimizers' float64 hyperparameters."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl

RNG = np.random.default_rng(0)
X = (RNG.normal(size=(32, 4)) + 1j * RNG.normal(size=(32, 4))).astype(np.complex64)
Y = (RNG.normal(size=(32, 2)) + 1j * RNG.normal(size=(32, 2))).astype(np.complex64)
DATA = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 32, 8)]


def _init(rng: Any, x: Any) -> dict[str, Any]:
    return {"w": jnp.full((x.shape[1], 2), 0.1 + 0.2j, jnp.result_type(x))}


def _apply(params: Any, x: Any) -> Any:
    return x @ params["w"]


def test_the_squared_error_of_complex_outputs_is_the_squared_distance():
    # It was the mean of Re(d**2): -1.7 as a "mean squared error"; as the loss, jax.grad
    # refused the complex objective.
    params = _init(None, X)
    evaluated = fl.evaluator((_init, _apply)).metric("mse").run(DATA, params)
    d = X @ np.asarray(params["w"]) - Y
    assert evaluated.metrics["mse"] == pytest.approx(float(np.mean(np.abs(d) ** 2)), rel=1e-6)
    trained = fl.trainer((_init, _apply), "mean_squared_error", "sgd").run(DATA, fuse=False)
    fused = fl.trainer((_init, _apply), "mean_squared_error", "sgd").run(DATA, fuse=2)
    np.testing.assert_array_equal(fused.params["w"], trained.params["w"])


def test_complex_params_descend():
    # jax.grad of a real loss gives a complex param the conjugate of its descent direction:
    # passed to optax as it was, sgd climbed (6.5 to 954 in 20 epochs) and adam stalled.
    w = (RNG.normal(size=(4, 2)) + 1j * RNG.normal(size=(4, 2))).astype(np.complex64)
    data = [(x, x @ w) for x, _ in DATA]
    for tx in (optax.sgd(0.05), optax.adam(0.05)):
        state = fl.trainer((_init, _apply), "mean_squared_error", tx).run(data, epochs=40)
        losses = [state.history[e]["loss"] for e in sorted(state.history)]
        assert losses[-1] < 0.01 * losses[0]
        np.testing.assert_allclose(state.params["w"], w, atol=0.05)


def test_a_metric_returning_complex_values_is_refused_by_name():
    # Its imaginary part was dropped by the float accumulator, with only JAX's warning.
    def bias(y_true: Any, y_pred: Any) -> Any:
        return jnp.mean(y_pred - y_true, axis=-1)

    evaluator = fl.evaluator((_init, _apply)).metric(bias, name="bias")
    with pytest.raises(TypeError, match=r"metric 'bias' returned complex values.*jnp\.abs"):
        evaluator.run(DATA, _init(None, X))


def test_complex128_params_get_the_named_optimizers_float64_hyperparameters():
    # They fell back to the float32 optimizer: b2 = 0.9990000128746, 1e-8 off optax.adam.
    with jax.enable_x64(True):
        data = [(x.astype(np.complex128), y.astype(np.complex128)) for x, y in DATA]
        state = fl.trainer((_init, _apply), "mean_squared_error", "adam").run(data)
        hyperparams = state.step_state["opt_state"].hyperparams
        assert {str(v.dtype) for v in hyperparams.values()} == {"float64"}
        assert state.params["w"].dtype == np.complex128


@pytest.mark.parametrize("fuse", [False, 2])
def test_a_plateau_lowers_the_injected_rate_of_complex_params(fuse):
    # optax holds the injected rate in the params' complex dtype: the handler's float()
    # of it failed at its first reduction.
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    loop = fl.trainer((_init, _apply), "mean_squared_error", tx).reduce_lr_on_plateau(
        "loss", factor=0.5, patience=0, min_delta=1e9
    )
    state = loop.run(DATA, epochs=3, fuse=fuse)
    rates = [state.history[e]["learning_rate"] for e in range(3)]
    assert rates == pytest.approx([1e-3, 1e-3, 5e-4])  # lowered at the ends of 1 and 2
    held = state.step_state["opt_state"].hyperparams["learning_rate"]
    assert held.dtype == np.complex64 and complex(held) == pytest.approx(2.5e-4)
