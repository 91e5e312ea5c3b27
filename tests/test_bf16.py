"""bfloat16 params: the named optimizers keep float32 hyperparameters and state, and a step
that changes a leaf's dtype or shape is a ValueError naming the leaf, fused and unfused."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import make_batches


class Bf16MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(x))
        return nn.Dense(3, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(x)


DATA = make_batches(8)


@functools.cache
def bf16_trainer(name: str) -> fl.Loop:
    """One Loop per named optimizer, shared by the tests (its programs traced once)."""
    return fl.trainer(Bf16MLP(), "sparse_categorical_cross_entropy", name)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_named_optimizers_train_bf16_params(name):
    loop = bf16_trainer(name)
    unfused = loop.run(DATA, epochs=3)
    fused = loop.run(DATA, epochs=3, fuse=4)
    assert all(np.isfinite(h["loss"]) for h in unfused.history.values())
    assert unfused.history == fused.history
    leaves = jax.tree.leaves(unfused.params)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    hyper = [
        leaf
        for leaf in jax.tree.leaves(unfused.step_state["opt_state"])
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    assert all(leaf.dtype == jnp.float32 for leaf in hyper)


def test_adam_bf16_actually_learns():
    state = bf16_trainer("adam").run(DATA, epochs=5)
    assert state.history[4]["loss"] < state.history[0]["loss"]


@pytest.mark.parametrize("fuse", [False, 4])
def test_a_step_that_promotes_a_leaf_is_a_value_error(fuse):
    promoting = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(
        learning_rate=1e-3
    )
    loop = fl.trainer(Bf16MLP(), "sparse_categorical_cross_entropy", promoting)
    with pytest.raises(ValueError) as info:
        loop.run(DATA, fuse=fuse)
    text = str(info.value)
    assert "step_state['opt_state']" in text
    assert "bfloat16" in text and "float32" in text


def test_a_custom_steps_own_params_widened_get_the_cast_fix_not_a_collection_one():
    """A custom step state's "params" of plain weights holds no flax collections: its
    widened leaf is told to cast back (it was told about BatchNorm's statistics)."""

    def step(batch, s):
        return {"params": {"w": s["params"]["w"] * jnp.float32(0.5)}}

    init = {"params": {"w": jnp.ones((3, 1), jnp.bfloat16)}}
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\].*Cast the result back") as info:
        fl.loop(step).run(DATA, init)
    assert "collection" not in str(info.value)


def test_a_step_that_makes_raw_key_data_a_typed_key_is_told_to_unwrap_it():
    def step(batch, s):
        key, sub = jax.random.split(jax.random.wrap_key_data(s["key"]))
        return {"key": key, "v": s["v"] + jax.random.uniform(sub, ())}

    init = {"key": jax.random.PRNGKey(0), "v": jnp.zeros(())}
    with pytest.raises(ValueError, match=r"\['key'\] from dtype uint32 .*jax.random.key_data"):
        fl.loop(step).run(DATA, init)


@pytest.mark.parametrize("fuse, jit", [(False, True), (2, True), (False, False)])
def test_a_custom_step_that_changes_a_shape_is_a_value_error(fuse, jit):
    def step(batch, s):
        return {"total": jnp.concatenate([s["total"], jnp.zeros(1)])}

    with pytest.raises(
        ValueError, match=r"step_state\['total'\].*shape \(2,\) to .*shape \(3,\)"
    ) as info:
        fl.loop(step).run(
            [(np.zeros(2, np.float32), np.zeros(2, np.float32))] * 3,
            {"total": jnp.zeros(2)},
            fuse=fuse,
            jit=jit,
        )
    # A jitted run finds it when its device loop is traced, then names the leaf and the
    # fix; an eager one (no loop to find it) checks the step before it runs.
    assert (info.value.__cause__ is not None) == jit
    assert info.value.fuseloop_state.status == "halted"


def test_a_run_whose_step_keeps_its_state_traces_the_step_once():
    traces = []

    def step(batch, s):
        traces.append(s)
        return {"total": s["total"] + batch[0].sum()}

    batches = [(np.ones(2, np.float32), np.zeros(2, np.float32))] * 3
    state = fl.loop(step).run(batches, {"total": jnp.zeros(())}, epochs=2)
    assert float(state.step_state["total"]) == 12.0
    assert len(traces) == 1  # the unfused program's trace; no abstract check beside it


def _float64_regression() -> tuple[nn.Dense, fl.data.ArraySource, dict]:
    """A float64 linear regression (under jax_enable_x64): model, data, initial variables."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4))
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]])
    model = nn.Dense(1, param_dtype=jnp.float64)
    data = fl.data.arrays(x, y, batch_size=8, shuffle=False)
    return model, data, model.init(jax.random.PRNGKey(0), x[:1])


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_named_optimizers_keep_float64_params_in_float64(name):
    """Under jax_enable_x64 the named optimizers train float64 params in float64, state and
    rate included, as the optax transformation they name does (their float32 widening is for
    bfloat16 and float16 only: it had narrowed float64 to float32). A named optimizer keeps
    its rate in its state (optax.inject_hyperparams), so it is compared with that: a rate
    that is a constant of the program rounds otherwise (an ulp in adam's update)."""
    factory = {"sgd": optax.sgd, "adam": optax.adam, "adamw": optax.adamw}[name]
    rate = {"sgd": 0.01, "adam": 1e-3, "adamw": 1e-3}[name]
    with jax.enable_x64(True):
        model, data, start = _float64_regression()
        named = fl.trainer(model, "mean_squared_error", name).run(data, start, epochs=3)
        injected = optax.inject_hyperparams(factory)(learning_rate=rate)
        hand = fl.trainer(model, "mean_squared_error", injected).run(data, start, epochs=3)
        floats = [
            leaf.dtype
            for leaf in jax.tree.leaves(named.step_state["opt_state"])
            if jnp.issubdtype(leaf.dtype, jnp.floating)
        ]
        assert set(floats) == {jnp.dtype(jnp.float64)}
        for a, b in zip(jax.tree.leaves(named.params), jax.tree.leaves(hand.params), strict=True):
            assert a.dtype == jnp.float64
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resident_dataset_placed_before_x64_was_switched_on_is_placed_again():
    # Its float32 device copy was reused: the run trained silently on the rounded data.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4))
    y = (x.sum(1) > 0).astype(np.int64)
    loop = fl.trainer(fl.models.mlp([4, 2]), "sparse_categorical_cross_entropy", "sgd")
    resident = fl.data.arrays(x, y, batch_size=8, device=True)
    with pytest.warns(UserWarning):  # float64 data is float32 on the device: said once
        loop.run(resident)
    with jax.enable_x64(True):
        again = loop.run(resident)
        host = loop.run(fl.data.arrays(x, y, batch_size=8))
        assert resident.put()[0].dtype == jnp.float64
    assert resident.transfers_done == 2
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(host.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_soft_targets_of_bf16_logits_are_taken_as_optax_takes_them():
    # Label smoothing: 0.92/0.02 rounded to bf16 would sum to 1.002 and bias the loss.
    x, labels = DATA[0]
    soft = (np.eye(3, dtype=np.float32)[labels] * 0.9 + 0.1 / 3).astype(np.float32)
    variables = jax.jit(Bf16MLP().init)(jax.random.PRNGKey(0), x)  # one compile, not eager ops
    tx = optax.sgd(0.1)

    def hand_loss(params):  # the losses of bf16 outputs are computed in float32
        logits = Bf16MLP().apply(params, x).astype(jnp.float32)
        return optax.softmax_cross_entropy(logits, soft).mean()

    loss, grads = jax.jit(jax.value_and_grad(hand_loss))(variables)
    expected = optax.apply_updates(variables, tx.update(grads, tx.init(variables))[0])
    state = fl.trainer(Bf16MLP(), "categorical_cross_entropy", tx).run([(x, soft)], variables)
    assert state.metrics["loss"] == pytest.approx(float(loss), rel=1e-6)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_population_hyperparameters_reach_float64_slots_unrounded():
    """Under jax_enable_x64 a population's learning rates are set at the slot's float64, as
    a solo run's optimizer holds them (they went through float32 first: 0.01 became
    0.0099999997764825820923)."""
    with jax.enable_x64(True):
        model, data, start = _float64_regression()
        loop = fl.trainer(model, "mean_squared_error", "sgd")
        pop = loop.run(data, start, epochs=2, population={"learning_rate": [0.01, 0.01]})
        solo = loop.run(data, start, epochs=2)
        slot = pop.step_state["opt_state"].hyperparams["learning_rate"]
        assert slot.dtype == jnp.float64 and np.asarray(slot).tolist() == [0.01, 0.01]
        for a, b in zip(
            jax.tree.leaves(pop.member(0).params), jax.tree.leaves(solo.params), strict=True
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-14)


class _Float64Norm(nn.Module):
    """A float64 model with BatchNorm, whose statistics flax starts in float32."""

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        x = nn.Dense(8, param_dtype=jnp.float64)(x)
        x = nn.BatchNorm(use_running_average=not train, param_dtype=jnp.float64)(x)
        return nn.Dense(3, param_dtype=jnp.float64)(x)


def test_batch_stats_widened_by_float64_inputs_are_named_with_the_fix_that_works():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(32, 6)), rng.integers(0, 3, 32).astype(np.int32)
        data = fl.data.arrays(x, y, 8)
        loop = fl.trainer(_Float64Norm(), "sparse_categorical_cross_entropy", "adam")
        with pytest.raises(ValueError, match=r"'batch_stats' collection.*float32.*float64"):
            loop.run(data, epochs=1, fuse=4)
        # The fix the message names: the statistics made float64 before the run.
        variables = jax.jit(_Float64Norm().init)(jax.random.key(0), x[:8])
        stats = jax.tree.map(lambda a: a.astype("float64"), variables["batch_stats"])
        state = loop.run(data, {**variables, "batch_stats": stats}, epochs=1, fuse=4)
        assert jax.tree.leaves(state.params["batch_stats"])[0].dtype == jnp.float64


def test_the_built_in_losses_of_bf16_outputs_are_computed_in_float32():
    """As Keras computes them: in bf16, each example's log-softmax over 1,000 classes is
    rounded, 2e-4 relative on the epoch loss."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = rng.integers(0, 1000, 64).astype(np.int32)
    weights = {"w": jnp.asarray(rng.normal(size=(16, 1000)), jnp.bfloat16)}
    model = fl.models.from_functions(
        lambda rng, x: weights, lambda p, x: x.astype(p["w"].dtype) @ p["w"]
    )

    @functools.partial(jax.jit, static_argnums=0)
    def hand(logits_dtype):
        logits = model.apply(weights, x).astype(logits_dtype)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    state = fl.evaluator(model, "sparse_categorical_cross_entropy").run([(x, y)], weights)
    assert state.metrics["loss"] == pytest.approx(float(hand(jnp.float32)), rel=1e-6)
    assert state.metrics["loss"] != pytest.approx(float(hand(jnp.bfloat16)), rel=1e-5)


def test_hyperparameters_injected_in_bf16_are_warned_about_once_with_their_rounded_values():
    # optax.inject_hyperparams takes the params' dtype: b2=0.999 reads 1.0 in bfloat16 and
    # the loss turns NaN, as in optax's own loop; the trainer says why, once per Loop.
    narrow = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    loop = fl.trainer(Bf16MLP(), "sparse_categorical_cross_entropy", narrow)
    with pytest.warns(UserWarning, match=r"bfloat16, where they round \(.*b2=1\.0.*named"):
        loop.run(DATA, epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.run(DATA, epochs=1)
        fl.trainer(Bf16MLP(), "sparse_categorical_cross_entropy", "adam").run(DATA)
