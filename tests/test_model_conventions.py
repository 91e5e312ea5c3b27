"""Model conventions a trainer must either follow exactly or refuse with the fix: key
parameters of plain functions, integer weights among the params, nnx modules that write
their own Params, hold no Params, keep dicts with tuple keys or Intermediates of their own,
nnx-shaped optimizer labels, and equinox fields a save must bring back as they were."""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fuseloop as fl
from conftest import assert_tree_equal


def _regression(n: int = 16) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, n, 8)]


_SEEN: list[bool] = []


def _with_key(params, x, key=None):
    _SEEN.append(key is not None)
    return x @ params["w"]


def _with_rng(params, x, rng=None):
    _SEEN.append(rng is not None)
    return x @ params["w"]


def _with_dropout_rng(params, x, *, dropout_rng=None):
    _SEEN.append(dropout_rng is not None)
    return x @ params["w"]


@pytest.mark.parametrize("apply_fn", [_with_key, _with_rng, _with_dropout_rng])
def test_a_plain_apply_gets_the_steps_key_under_its_own_name(apply_fn):
    _SEEN.clear()

    def init_fn(rng, x):
        return {"w": jax.random.normal(rng, (x.shape[1], 2)) * 0.3}

    batches = _regression()
    state = fl.trainer((init_fn, apply_fn), "mse", optax.sgd(0.1)).run(batches, epochs=1)
    assert True in _SEEN  # the training step's trace was given a key
    _SEEN.clear()
    fl.predict((init_fn, apply_fn), state, batches[0][0])
    assert _SEEN and not any(_SEEN)  # outside training: None


class _Clip(nnx.Module):
    def __init__(self, rngs):
        self.layer = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        self.layer.kernel[...] = jnp.clip(self.layer.kernel[...], -0.3, 0.3)
        return self.layer(x)


def test_an_nnx_module_writing_its_own_params_is_refused_with_the_path():
    loop = fl.trainer(_Clip(nnx.Rngs(0)), "mse", optax.sgd(0.1))
    with pytest.raises(
        fl.models.ModelConventionError, match=r"writes its own nnx.Param\(s\) \(layer.kernel\)"
    ):
        loop.run(_regression(), epochs=1)


class _Rematted(nnx.Module):
    """A checkpointed block (`nnx.remat`), optionally clipping its own kernel inside it."""

    def __init__(self, rngs, clip=False):
        self.hidden, self.out, self.clip = (
            nnx.Linear(4, 8, rngs=rngs),
            nnx.Linear(8, 2, rngs=rngs),
            clip,
        )

    def __call__(self, x):
        def block(layer, x):
            if self.clip:
                layer.kernel[...] = jnp.clip(layer.kernel[...], -0.3, 0.3)
            return nnx.relu(layer(x))

        return self.out(nnx.remat(block)(self.hidden, x))


def test_an_nnx_remat_block_trains_as_an_nnx_optimizer_loop():
    # nnx.remat writes every Variable back as a new value: it was refused as a Param write.
    model = _Rematted(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    for x, y in _regression():
        step(model, optimizer, x, y)
    for fuse in (False, 2):
        state = fl.trainer(_Rematted(nnx.Rngs(0)), "mse", optax.sgd(0.1)).run(
            _regression(), epochs=1, fuse=fuse
        )
        expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        assert_tree_equal(state.params["params"], expected)
    with pytest.raises(fl.models.ModelConventionError, match=r"Param\(s\) \(hidden.kernel\)"):
        fl.trainer(_Rematted(nnx.Rngs(0), clip=True), "mse", "sgd").run(_regression())


def test_an_nnx_scan_over_rematted_layers_evaluates_without_drawing():
    # In evaluation its Dropout draws nothing; the count nnx.remat hands back inside the
    # scan was taken for a draw and fl.predict refused the model.
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.drop = nnx.Linear(4, 4, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(nnx.relu(self.lin(x)))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)

        def __call__(self, x):
            body = nnx.remat(lambda h, block: block(h))
            return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)

    model = Stack(nnx.Rngs(0, dropout=1))
    x = _regression()[0][0]
    model.eval()
    np.testing.assert_array_equal(fl.predict(model, model, x), model(x))


def test_an_nnx_module_without_params_is_refused_naming_its_variable_kinds():
    class Weight(nnx.Variable):
        pass

    class Net(nnx.Module):
        def __init__(self):
            self.w = Weight(jnp.ones((4, 2)))

        def __call__(self, x):
            return x @ self.w[...]

    with pytest.raises(fl.models.ModelConventionError, match="no parameters to train.*Weight"):
        fl.trainer(Net(), "mse", optax.sgd(0.1)).run(_regression(), epochs=1)


class _LinenCounter(nn.Module):
    collection: str = "params"

    @nn.compact
    def __call__(self, x, train: bool = False):
        count = self.variable(self.collection, "count", lambda: jnp.zeros((), jnp.int32))
        return nn.Dense(2)(x) + count.value


class _Count(nnx.Variable):
    pass


class _NnxCounter(nnx.Module):
    def __init__(self, rngs, kind):
        self.layer = nnx.Linear(4, 2, rngs=rngs)
        self.count = kind(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return self.layer(x) + self.count[...]


def test_an_integer_weight_among_the_params_is_refused_naming_it_and_its_fix():
    linen_error = r"params\['count'\] has dtype int32.*another collection"
    with pytest.raises(fl.models.ModelConventionError, match=linen_error):
        fl.trainer(_LinenCounter(), "mse", optax.sgd(0.1)).run(_regression(), epochs=1)
    nnx_error = r"params\['count'\] has dtype int32.*not an nnx.Param"
    with pytest.raises(fl.models.ModelConventionError, match=nnx_error):
        model = _NnxCounter(nnx.Rngs(0), nnx.Param)
        fl.trainer(model, "mse", optax.sgd(0.1)).run(_regression(), epochs=1)
    # the fixes the errors name train, and carry the integer unchanged
    for model in (_LinenCounter("counters"), _NnxCounter(nnx.Rngs(0), _Count)):
        state = fl.trainer(model, "mse", optax.sgd(0.1)).run(_regression(), epochs=1)
        assert np.isfinite(state.history[0]["loss"])


def test_an_nnx_dict_of_layers_keyed_by_tuples_trains_fused_as_unfused():
    class Experts(nnx.Module):
        def __init__(self, rngs):
            self.experts = nnx.data(
                {("e", 0): nnx.Linear(4, 2, rngs=rngs), ("e", 1): nnx.Linear(4, 2, rngs=rngs)}
            )

        def __call__(self, x):
            return sum(layer(x) for layer in self.experts.values())

    runs = [
        fl.trainer(Experts(nnx.Rngs(0)), "mse", optax.sgd(0.1)).run(
            _regression(32), epochs=2, fuse=fuse
        )
        for fuse in (False, 3)
    ]
    assert_tree_equal(runs[0].params, runs[1].params)


def test_an_nnx_intermediate_held_as_an_attribute_is_state_it_keeps():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layer = nnx.Linear(4, 2, rngs=rngs)
            self.last_mean = nnx.Intermediate(jnp.zeros((2,)))

        def __call__(self, x):
            y = self.layer(x)
            self.last_mean[...] = y.mean(0)
            return y

    state = fl.trainer(Net(nnx.Rngs(0)), "mse", optax.sgd(0.1)).run(_regression(), epochs=1)
    assert np.any(np.asarray(state.params["state"]["last_mean"]) != 0)


def test_optimizer_labels_built_from_an_nnx_state_are_refused_with_the_pure_dict_fix():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lora = nnx.LoRALinear(4, 2, lora_rank=2, rngs=rngs)

        def __call__(self, x):
            return self.lora(x)

    model = Net(nnx.Rngs(0))
    labels = jax.tree.map(
        lambda v: "train" if isinstance(v, nnx.LoRAParam) else "frozen",
        nnx.state(model, nnx.Param),
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    tx = optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no false "the optimizer freezes nothing"
        with pytest.raises(ValueError, match=r"nnx.to_pure_dict\(nnx.state\(model, nnx.Param\)\)"):
            fl.trainer(model, "mse", tx).run(_regression(), epochs=1)


class _Typed(eqx.Module):
    linear: eqx.nn.Linear
    dtype: type = eqx.field(static=True)
    scale: float = 2.0  # left to its class default by __init__

    def __init__(self, key, dtype):
        self.linear = eqx.nn.Linear(4, 2, key=key, dtype=dtype)
        self.dtype = dtype

    def __call__(self, x):
        return self.linear(x.astype(self.dtype)) * self.scale


@pytest.mark.parametrize("dtype", [jnp.float32, np.float32, np.dtype("float32")], ids=str)
def test_an_equinox_model_with_a_dtype_and_a_default_field_saves_loads_and_resumes(tmp_path, dtype):
    loop = fl.trainer(_Typed(jax.random.PRNGKey(0), dtype), "mse", optax.sgd(0.1))
    batches = _regression()
    state = loop.run(batches, epochs=1)
    fl.save_state(state, tmp_path / "state")
    loaded = fl.load_state(tmp_path / "state")
    assert jax.tree.structure(loaded.params) == jax.tree.structure(state.params)
    resumed = loop.run(batches, loaded, epochs=2)
    assert_tree_equal(resumed.params, loop.run(batches, epochs=2).params)


def test_a_custom_loops_equinox_params_kept_as_a_module_validate_predict_and_rebuild():
    # eqx.partition's array half as step_state["params"]: the evaluator took it, but
    # validate, predict given the State and fl.models.trained blamed x or refused it.
    # Built in one jitted program (built eagerly, each initialiser op compiles its own).
    model = eqx.filter_jit(lambda: eqx.nn.MLP(4, 2, 8, 1, key=jax.random.PRNGKey(0)))()
    weights, static = eqx.partition(model, eqx.is_inexact_array)
    tx = optax.sgd(0.1)

    def init_fn(batch, _):
        return {"params": weights, "opt_state": tx.init(weights), "y_pred": batch[1]}

    def step_fn(batch, state):
        x, y = batch

        def loss(p):
            y_pred = jax.vmap(eqx.combine(p, static))(x)
            return jnp.mean((y_pred - y) ** 2), y_pred

        grads, y_pred = jax.grad(loss, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "y_pred": y_pred}

    data = _regression()
    loop = fl.loop(step_fn, init_fn).metric("mean_squared_error").validate(model, data)
    state = loop.run(data, 0, epochs=2)
    hand = eqx.combine(state.params, static)
    # One jitted program for both modules (eagerly, each op compiles its own).
    batched = eqx.filter_jit(lambda module, x: jax.vmap(module)(x))
    expected = np.asarray(batched(hand, data[0][0]))
    np.testing.assert_array_equal(np.asarray(fl.predict(model, state, data[0][0])), expected)
    rebuilt = fl.models.trained(model, state)
    np.testing.assert_array_equal(np.asarray(batched(rebuilt, data[0][0])), expected)
    evaluator = fl.evaluator(model).metric("mean_squared_error")
    validated = evaluator.run(data, state.params).metrics["mean_squared_error"]
    assert state.metrics["validation_mean_squared_error"] == validated


class _ScaledLinear(eqx.Module):
    linear: eqx.nn.Linear
    activation: object = eqx.field(static=True)

    def __call__(self, x):
        return self.activation(self.linear(x))


def test_a_lambda_activation_field_is_refused_by_a_checkpoint_before_training_naming_def(
    tmp_path,
):
    model = _ScaledLinear(eqx.nn.Linear(4, 2, key=jax.random.PRNGKey(0)), lambda z: z * 2)
    epochs: list[int] = []
    loop = fl.trainer(model, "mean_squared_error", "sgd").handle_event(
        "epoch_completed", lambda state: epochs.append(state.epoch)
    )
    with pytest.raises(ValueError, match=r"\.activation=function .* define it with def"):
        loop.checkpoint(tmp_path / "ckpt").run(_regression(), epochs=2)
    assert epochs == []  # refused at the start, not after an epoch's work
    state = loop.run(_regression(), epochs=1)  # trains; only its save is refused
    with pytest.raises(ValueError, match=r"define it with def at a module's top level"):
        fl.save_state(state, tmp_path / "state")


def test_an_nnx_module_changed_after_the_trainer_took_it_is_named_not_blamed_on_x():
    # A new head or a changed dropout rate was reported as "x does not fit the model".
    model = nnx.Sequential(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.1))
    loop = fl.trainer(model, "mean_squared_error", "sgd")
    model.layers[1].rate = 0.5
    with pytest.raises(fl.models.ModelConventionError, match=r"^the nnx module changed"):
        loop.run(_regression())


def test_an_evaluator_given_no_variables_names_an_nnx_module_as_its_own():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    evaluator = fl.evaluator(model, "mean_squared_error")
    with pytest.raises(ValueError, match=r"a module built with its weights is one: \.run"):
        evaluator.run(_regression())
    assert np.isfinite(evaluator.run(_regression(), model).metrics["loss"])


class _Sowing(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        self.sow(nnx.Intermediate, "features", x)
        return self.linear(x)


def test_what_a_shape_check_sowed_is_refused_by_a_trainer_naming_nnx_pop():
    # A `model(x)` before training left a sown tuple the trainer carried and grew: the
    # run failed on a step-state structure change.
    checked = _Sowing()
    checked(jnp.ones((2, 4)))
    with pytest.raises(fl.models.ModelConventionError, match=r"nnx.pop\(model, nnx.Interm"):
        fl.trainer(checked, "mean_squared_error", "sgd").run(_regression())
    nnx.pop(checked, nnx.Intermediate)  # the fix it names
    popped = fl.trainer(checked, "mean_squared_error", "sgd").run(_regression())
    fresh = fl.trainer(_Sowing(), "mean_squared_error", "sgd").run(_regression())
    assert_tree_equal(popped.params, fresh.params)


class _Total(nnx.Variable):
    pass


class _SowingAVariable(nnx.Module):
    """Sows a running total into a Variable type of its own, not declared in __init__."""

    def __init__(self):
        self.linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        self.sow(_Total, "total", x.sum(), init_fn=lambda: jnp.zeros(()), reduce_fn=jnp.add)
        return self.linear(x)


def test_a_variable_an_nnx_call_makes_anew_is_told_to_be_made_in_init():
    """The step's structure changed; the message named neither nnx nor the fix."""
    with pytest.raises(ValueError, match=r"\['total'\] appears after .* __init__.* a reduce_fn"):
        fl.trainer(_SowingAVariable(), "mean_squared_error", "sgd").run(_regression())


class _ActNorm(nn.Module):
    """Glow's ActNorm: its shift and scale start from the first batch's statistics."""

    @nn.compact
    def __call__(self, x):
        shift = self.param("shift", lambda rng: -jnp.mean(x, axis=0))
        scale = self.param("scale", lambda rng: 1.0 / (jnp.std(x, axis=0) + 1e-6))
        return nn.Dense(3)((x + shift) * scale)


@pytest.mark.parametrize("population", [None, 2])
def test_a_data_dependent_init_reads_the_first_batch_as_model_init_does(population):
    """The trainer initialised a model on a batch of zeros shaped like the first: an
    ActNorm's scale started at 1e6 (1 / eps), where `model.init(rng, first_x)` reads the
    data, and the loss was in the millions without a word."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(8, 4)) * 3 + 5).astype(np.float32)
    data = [(x, rng.integers(0, 3, 8).astype(np.int32))]
    model = _ActNorm()
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.0))
    loop.run([(x * 2, data[0][1])], population=population)  # a run before, on other data
    state = loop.run(data, population=population)  # its fresh init is not that run's spare
    # model.init in one jitted program (eagerly, each op compiles its own), keeping the two
    # parameters compared (the Dense kernel's initialiser is then left out of the program).
    by_hand = jax.jit(
        lambda x: {k: model.init(jax.random.PRNGKey(0), x)["params"][k] for k in ("shift", "scale")}
    )(x)
    for name in ("shift", "scale"):
        got = np.asarray(state.params["params"][name])
        expected = np.asarray(by_hand[name])
        np.testing.assert_allclose(
            got.reshape(-1, 4), np.broadcast_to(expected, got.reshape(-1, 4).shape), rtol=1e-6
        )
