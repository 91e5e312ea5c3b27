"""Models that initialise when they are built (flax.nnx, equinox): a run starts from the
module's weights as they are when it starts, and a population cannot pretend its seeds
re-initialise them."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fuseloop as fl
from conftest import FEATURES, make_batches

SPARSE = "sparse_categorical_cross_entropy"


def _nnx_model() -> nnx.Module:
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(FEATURES, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 3, rngs=rngs))


def _first_kernel(state: fl.State) -> np.ndarray:
    return np.asarray(state.params["params"]["layers"][0]["kernel"])


def test_an_nnx_run_starts_from_weights_loaded_after_the_trainer_was_built():
    module = _nnx_model()
    loop = fl.trainer(module, SPARSE, optax.sgd(0.0))  # a rate of 0: params stay as started
    data = make_batches(4)
    first = loop.run(data)
    np.testing.assert_array_equal(_first_kernel(first), module.layers[0].kernel[...])
    loaded = np.full((FEATURES, 8), 0.5, np.float32)
    module.layers[0].kernel[...] = loaded  # e.g. pretrained weights, loaded in place
    second = loop.run(data)
    np.testing.assert_array_equal(_first_kernel(second), loaded)
    assert second.stats["compiles"] == 0  # new values, same program
    # The run did not change the module.
    np.testing.assert_array_equal(module.layers[0].kernel[...], loaded)


def test_an_nnx_run_takes_variables_and_layers_assigned_anew_after_the_trainer_was_built():
    module = _nnx_model()
    loop = fl.trainer(module, SPARSE, optax.sgd(0.0))
    data = make_batches(4)
    loop.run(data)
    loaded = np.full((FEATURES, 8), 0.25, np.float32)
    module.layers[0].kernel = nnx.Param(jax.numpy.asarray(loaded))  # a new Variable object
    np.testing.assert_array_equal(_first_kernel(loop.run(data)), loaded)
    module.layers[0] = nnx.Linear(FEATURES, 8, rngs=nnx.Rngs(7))  # a new layer, same shape
    state = loop.run(data)
    np.testing.assert_array_equal(_first_kernel(state), module.layers[0].kernel[...])
    assert state.stats["compiles"] == 0
    module.eval()  # a mode switch is the adapter's to set in every traced call
    np.testing.assert_array_equal(_first_kernel(loop.run(data)), module.layers[0].kernel[...])


def test_an_nnx_module_changed_in_structure_after_the_trainer_was_built_is_refused():
    module = _nnx_model()
    loop = fl.trainer(module, SPARSE, "adam")
    loop.run(make_batches(4))
    module.layers[2] = nnx.Linear(8, 5, rngs=nnx.Rngs(1))  # a new head of another shape
    with pytest.raises(ValueError, match=r"changed structure.*layers\.2\.kernel.*fl\.trainer"):
        loop.run(make_batches(4))


def test_a_population_of_an_nnx_model_that_varies_only_seeds_is_refused():
    loop = fl.trainer(_nnx_model(), SPARSE, "adam")
    with pytest.raises(ValueError, match=r"nnx model is initialised when built.*learning_rate"):
        loop.run(make_batches(4), population=2)
    with pytest.raises(ValueError, match="initialised when built"):
        loop.run(make_batches(4), population={"seed": [3, 4]})


def test_a_population_of_an_nnx_model_varying_a_rate_starts_every_member_from_the_module():
    module = _nnx_model()
    loop = fl.trainer(module, SPARSE, "adam")
    with warnings.catch_warnings():  # the default seeds (0, 1) ask for nothing: no warning
        warnings.simplefilter("error")
        state = loop.run(make_batches(4), population={"learning_rate": [0.0, 1e-2]})
    frozen, moved = state.member(0), state.member(1)
    np.testing.assert_array_equal(_first_kernel(frozen), module.layers[0].kernel[...])
    assert not np.array_equal(_first_kernel(moved), _first_kernel(frozen))
    # Seeds varied beside the rate reach nothing of an nnx model: members alike but for
    # their seeds trained identically, without a word (a solo run's seed= warns).
    grid = {"learning_rate": [0.0, 1e-2, 0.0, 1e-2], "seed": [0, 0, 1, 1]}
    with pytest.warns(UserWarning, match=r"member seeds \[0, 0, 1, 1\] have no effect"):
        twins = loop.run(make_batches(4), population=grid)
    np.testing.assert_array_equal(_first_kernel(twins.member(1)), _first_kernel(twins.member(3)))


def test_a_population_started_from_given_variables_that_varies_only_seeds_is_refused():
    """The member seeds reach a linen model's weights only through its init: given the
    variables to start from, the members trained bitwise alike (found by a user)."""
    model = fl.models.mlp([8, 3])
    # In the shapes model.init gives, drawn on the host (an eager init compiles each op).
    shapes = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x), make_batches(1)[0][0])
    rng = np.random.default_rng(0)
    variables = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)
    loop = fl.trainer(model, SPARSE, "adam")
    with pytest.raises(ValueError, match=r"variables given as init_state.*leave init_state out"):
        loop.run(make_batches(4), variables, population=2)
    state = loop.run(make_batches(4), variables, population={"learning_rate": [0.0, 1e-2]})
    frozen = state.member(0).params["params"]["Dense_0"]["kernel"]
    np.testing.assert_array_equal(frozen, variables["params"]["Dense_0"]["kernel"])


def test_a_population_of_an_equinox_model_that_varies_only_seeds_is_refused():
    eqx = pytest.importorskip("equinox")
    # Its arrays drawn on the host (equinox's initialisers compile a program per op).
    shapes = eqx.filter_eval_shape(eqx.nn.MLP, FEATURES, 3, 8, 1, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    model = jax.tree.map(
        lambda s: (
            rng.normal(0, 0.5, s.shape).astype(s.dtype)
            if isinstance(s, jax.ShapeDtypeStruct)
            else s
        ),
        shapes,
    )
    loop = fl.trainer(model, SPARSE, "adam")
    with pytest.raises(ValueError, match="equinox model is initialised when built"):
        loop.run(make_batches(4), population=3)


def test_a_linen_population_still_draws_each_member_from_its_seed():
    state = fl.trainer(fl.models.mlp([8, 3]), SPARSE, "adam").run(make_batches(4), population=2)
    assert not np.array_equal(
        jax.tree.leaves(state.member(0).params)[0], jax.tree.leaves(state.member(1).params)[0]
    )


class _Scaled(nnx.Module):
    """A model with a static attribute a user may change after training (a temperature)."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(FEATURES, 3, rngs=nnx.Rngs(0))
        self.temperature = 1.0

    def __call__(self, x):
        return self.linear(x) / self.temperature


def test_an_nnx_module_changed_after_predict_or_evaluator_took_it_is_predicted_as_it_is_now():
    module = _Scaled()
    variables = fl.models.from_nnx(module).init(None, None)
    x, y = make_batches(1)[0]
    evaluation = fl.evaluator(module, SPARSE)
    evaluation.run([(x, y)], variables)
    before = fl.predict(module, variables, x)
    module.temperature = 4.0  # calibrated after a first prediction
    after = fl.predict(module, variables, x)
    np.testing.assert_allclose(after, before / 4.0, rtol=1e-6)
    np.testing.assert_array_equal(after, np.asarray(fl.models.trained(module, variables)(x)))
    # A loop compiled the module as it was: its next run refuses, with variables given too.
    with pytest.raises(ValueError, match=r"changed structure.*temperature.*fl\.evaluator"):
        evaluation.run([(x, y)], variables)
    loop = fl.trainer(module, SPARSE, "sgd")
    loop.run([(x, y)], variables)
    module.temperature = 2.0
    with pytest.raises(ValueError, match=r"^the nnx module changed structure.*temperature"):
        loop.run([(x, y)], variables)


class _Adapted(nnx.Module):
    """A frozen-base LoRA layer, as nnx's LoRA tutorial builds one."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.base = nnx.Linear(4, 3, rngs=rngs)
        self.lora = nnx.LoRA(4, 2, 3, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.base(x) + self.lora(x)


def test_an_nnx_lora_model_warns_that_every_param_trains_unless_the_optimizer_freezes():
    with pytest.warns(UserWarning, match=r"LoRAParam variables: fuseloop trains every nnx.Param"):
        fl.trainer(_Adapted(), "sparse_categorical_cross_entropy", optax.sgd(0.1))
    # The fix it names: the base frozen by the optimizer; then nothing to warn about.
    params = fl.models.from_nnx(_Adapted()).init(None, None)["params"]
    labels = {
        k: jax.tree.map(lambda _, k=k: "train" if k == "lora" else "frozen", v)
        for k, v in params.items()
    }
    frozen = optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop = fl.trainer(_Adapted(), "sparse_categorical_cross_entropy", frozen)
        # also behind a transformation that reads the loss (value=), as a step passes it
        plateau = optax.chain(frozen, optax.contrib.reduce_on_plateau())
        fl.trainer(_Adapted(), "sparse_categorical_cross_entropy", plateau)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    state = loop.run([(x, np.zeros(8, np.int32))])
    np.testing.assert_array_equal(
        state.params["params"]["base"]["kernel"], params["base"]["kernel"]
    )
