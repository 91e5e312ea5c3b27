"""Train/eval mode by every common convention (linen flags, nnx's switch, equinox's
inference mode), and `fl.models.trained`."""

from __future__ import annotations

import inspect
import pickle
import threading
import warnings
from collections import OrderedDict

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fuseloop as fl
from conftest import assert_tree_close, assert_tree_equal
from fuseloop._loop import Loop
from fuseloop._step import default_metrics, evaluator_program

SPARSE = "sparse_categorical_cross_entropy"
RNG = np.random.default_rng(0)
DATA = [
    (RNG.normal(size=(8, 5)).astype(np.float32), RNG.integers(0, 3, 8).astype(np.int32))
    for _ in range(4)
]


def evaluator_with_loss(model, loss=SPARSE):
    if "loss" in inspect.signature(fl.evaluator).parameters:
        return fl.evaluator(model, loss=loss)
    program = evaluator_program(model, loss)
    return Loop(program, metrics=default_metrics(program))


def frozen_train_loss(model, variables=None):
    """The epoch's training loss with learning rate 0 (params never change)."""
    return fl.trainer(model, SPARSE, optax.sgd(0.0)).run(DATA, variables)


def make_linen(flag: str, train_value: bool):
    """A linen MLP with BatchNorm and Dropout switched by a flag named `flag`."""

    def body(self, x, value):
        training = value == train_value
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not training)(x)
        x = nn.Dropout(0.5, deterministic=not training)(nn.relu(x))
        return nn.Dense(3)(x)

    namespace = {"__annotations__": {}}
    source = (
        f"def __call__(self, x, {flag}: bool = {not train_value}):\n"
        f"    return body(self, x, {flag})\n"
    )
    exec(source, {"body": body}, namespace)  # noqa: S102 - builds the flag's name
    call = nn.compact(namespace["__call__"])
    return type(f"Net_{flag}", (nn.Module,), {"__call__": call})()


@pytest.mark.parametrize(
    "flag, train_value",
    [
        ("train", True),
        ("training", True),
        ("is_training", True),
        ("deterministic", False),
        ("use_running_average", False),
    ],
)
def test_linen_flags_switch_dropout_and_batchnorm(flag, train_value):
    model = make_linen(flag, train_value)
    state = frozen_train_loss(model)
    init = model.init(jax.random.PRNGKey(0), DATA[0][0], **{flag: not train_value})
    # BatchNorm updated its statistics while training ...
    moved = jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
        state.params["batch_stats"],
        dict(init)["batch_stats"],
    )
    assert all(jax.tree.leaves(moved))
    # ... and dropout made the training loss differ from the evaluation loss.
    evaluated = evaluator_with_loss(model).run(DATA, state.params)
    assert state.metrics["loss"] != pytest.approx(evaluated.metrics["loss"], rel=1e-3)
    loop = fl.trainer(model, SPARSE, "adam")  # one Loop, its fused and unfused programs
    fused, unfused = loop.run(DATA, epochs=2, fuse=2), loop.run(DATA, epochs=2)
    assert fused.history == unfused.history


def test_linen_named_flag_with_given_polarity():
    model = make_linen("mode_is_eval", False)
    with pytest.raises(ValueError, match="train_value is needed"):
        fl.models.linen(model, train_arg="mode_is_eval")
    with pytest.raises(ValueError, match="not an argument"):
        fl.models.linen(model, train_arg="nope", train_value=True)
    adapter = fl.models.linen(model, train_arg="mode_is_eval", train_value=False)
    state = frozen_train_loss(adapter)
    assert not np.allclose(np.asarray(state.params["batch_stats"]["BatchNorm_0"]["var"]), 1.0)


def test_linen_named_flag_infers_polarity_of_known_names():
    model = make_linen("deterministic", False)
    adapter = fl.models.linen(model, train_arg="deterministic")
    assert adapter.mode(True) == {"deterministic": False}


class NoFlagBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=False)(x))


class GuardedWrite(nn.Module):
    """Writes its statistics only where the collection is mutable, as flax layers do."""

    @nn.compact
    def __call__(self, x):
        mean = self.variable("batch_stats", "mean", lambda: jnp.zeros(x.shape[-1]))
        if self.is_mutable_collection("batch_stats"):
            mean.value = 0.9 * mean.value + 0.1 * x.mean(0)
        return nn.Dense(3)(x - mean.value)


class SowsItsStatistic(nn.Module):
    """Keeps the last batch's mean activation by `sow`, which flax drops in silence where
    the collection is not mutable: its statistic stayed at init's value."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4)(x)
        self.sow("stats", "mean", h.mean(), init_fn=lambda: jnp.zeros(()), reduce_fn=lambda a, b: b)
        return nn.Dense(3)(h)


class NoFlagDropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=False)(x))


class UnknownFlagDropout(nn.Module):
    """Dropout switched by a flag fuseloop does not know, off by default."""

    @nn.compact
    def __call__(self, x, eval_mode: bool = True):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=eval_mode)(x))


class AttributeDropout(nn.Module):
    """Dropout switched by a module attribute, off by default."""

    deterministic: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=self.deterministic)(x))


@pytest.mark.parametrize(
    "module, need",
    [
        (NoFlagBatchNorm(), r"writes its collections \['batch_stats'\]"),
        (GuardedWrite(), r"writes its collections \['batch_stats'\]"),
        (SowsItsStatistic(), r"sows into its collections \['stats'\]"),
        (NoFlagDropout(), "'dropout' rng"),
        # Trained as it is, its Dropout would stay off: silently another model.
        (UnknownFlagDropout(), "contains Dropout, which would stay off while training"),
        (AttributeDropout(), "contains Dropout, which would stay off while training"),
    ],
)
@pytest.mark.parametrize("fuse", [False, 2])
def test_linen_without_a_flag_is_refused_at_the_first_batch(module, need, fuse):
    with pytest.raises(ValueError, match=need) as info:
        fl.trainer(module, SPARSE, "sgd").run(DATA, fuse=fuse)
    assert "train_arg" in str(info.value)


class FrozenBatchNorm(nn.Module):
    """A fine-tuning model: its BatchNorm's statistics are frozen, it has no flag."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(8)(x))))


class FrozenCollection(nn.Module):
    """Pretrained weights kept apart from "params", read and never written."""

    @nn.compact
    def __call__(self, x):
        w = self.variable("frozen", "w", lambda: jnp.full((x.shape[-1], 8), 0.1)).value
        return nn.Dense(3)(nn.relu(x @ w))


class RematFrozen(nn.Module):
    """A frozen BatchNorm under gradient checkpointing: the lifted transform hands the
    unchanged statistics back as new values, which are no write."""

    @nn.compact
    def __call__(self, x):
        return nn.remat(FrozenBatchNorm)()(x)


@pytest.mark.parametrize("module", [FrozenBatchNorm(), FrozenCollection(), RematFrozen()])
@pytest.mark.parametrize("fuse", [False, 2])
def test_linen_without_a_flag_trains_collections_it_only_reads_as_a_plain_loop(module, fuse):
    variables = jax.jit(module.init)(jax.random.PRNGKey(0), DATA[0][0])
    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    tx = optax.sgd(0.1)
    opt_state = tx.init(params)

    def loss(p, x, y):
        logits = module.apply({"params": p, **rest}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit  # one program, not an eager compile per operation
    def plain_step(params, opt_state, x, y):
        updates, opt_state = tx.update(jax.grad(loss)(params, x, y), opt_state)
        return optax.apply_updates(params, updates), opt_state

    for x, y in DATA:  # the plain loop: apply(variables, x), nothing written
        params, opt_state = plain_step(params, opt_state, x, y)
    state = fl.trainer(module, SPARSE, tx).run(DATA, variables, fuse=fuse)
    np.testing.assert_allclose(
        np.concatenate([np.ravel(a) for a in jax.tree.leaves(state.params["params"])]),
        np.concatenate([np.ravel(a) for a in jax.tree.leaves(params)]),
        rtol=1e-5,  # remat recomputes: XLA may round a value apart
    )
    for name, collection in rest.items():  # bitwise as given
        assert jax.tree.all(jax.tree.map(np.array_equal, state.params[name], collection))


def test_linen_dropout_under_an_unknown_flag_trains_once_it_is_named():
    def trained(train_value: bool) -> list:
        named = fl.models.linen(
            UnknownFlagDropout(), train_arg="eval_mode", train_value=train_value
        )
        return jax.tree.leaves(fl.trainer(named, SPARSE, "sgd").run(DATA, fuse=2).params)

    # eval_mode=False while training switches the Dropout on; eval_mode=True leaves it off.
    on, off = trained(False), trained(True)
    assert not all(np.array_equal(a, b) for a, b in zip(on, off, strict=True))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.dense(x)))))


class NnxOwnFlag(nnx.Module):
    """A user's module with its own plain-bool `training` attribute."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 3, rngs=rngs)
        self.training = False
        self.rngs = rngs

    def __call__(self, x):
        y = self.dense(x)
        if self.training:
            y = y + 1.0  # visibly different while training
        return y


def test_nnx_train_and_eval_modes():
    model = NnxNet(nnx.Rngs(0))
    state = frozen_train_loss(model)
    assert not np.allclose(np.asarray(state.params["state"]["norm"]["mean"]), 0.0)
    evaluated = evaluator_with_loss(model).run(DATA, state.params)
    assert state.metrics["loss"] != pytest.approx(evaluated.metrics["loss"], rel=1e-3)
    loop = fl.trainer(model, SPARSE, "adam")  # one Loop, its fused and unfused programs
    fused, unfused = loop.run(DATA, epochs=2, fuse=2), loop.run(DATA, epochs=2)
    assert fused.history == unfused.history
    trained = fl.models.trained(model, unfused)
    np.testing.assert_array_equal(
        np.asarray(trained(DATA[0][0])),
        np.asarray(fl.models.as_model(model).apply(unfused.params, DATA[0][0])),
    )


def test_nnx_layers_set_to_evaluation_mode_are_named_when_a_trainer_takes_them():
    """A trainer runs its steps in training mode (module.train()), so a BatchNorm frozen by
    hand would train silently: it warns, naming the layers and the per-call flag that keeps
    one frozen."""
    model = NnxNet(nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(model, SPARSE, "adam")  # flax builds its layers in training mode
        fl.trainer(NnxOwnFlag(nnx.Rngs(0)), SPARSE, "adam")  # a user's flag, off until trained
    model.norm.use_running_average = True  # frozen by hand, while the dropout trains
    with pytest.warns(UserWarning, match=r"\(norm\.use_running_average=True\): a trainer") as seen:
        fl.trainer(model, SPARSE, "adam")
    assert "self.bn(x, use_running_average=True)" in str(seen[0].message)
    model.eval()  # wholly in evaluation mode, as fl.models.trained returns it: switched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(model, SPARSE, "adam")
    # Frozen after the trainer was built: its run says so, once for the layers held.
    model = NnxNet(nnx.Rngs(0))
    loop = fl.trainer(model, SPARSE, "adam")
    model.norm.use_running_average = True
    with pytest.warns(UserWarning, match=r"\(norm\.use_running_average=True\): a trainer"):
        loop.run(DATA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.run(DATA)


def test_nnx_variables_of_other_shapes_are_refused_by_name():
    """nnx takes a given value of any shape into the module (a 5-class head loaded into a
    3-class model trained and predicted 5 classes); each path is named instead."""
    model = NnxNet(nnx.Rngs(0))
    variables = fl.models.as_model(model).init(None, None)
    variables["params"]["out"] = {"kernel": jnp.zeros((16, 5)), "bias": jnp.zeros(5)}
    named = r"params\['out'\]\['bias'\]: \(5,\) given, \(3,\) in the module"
    with pytest.raises(ValueError, match=named):
        fl.trainer(model, SPARSE, "adam").run(DATA, variables)
    with pytest.raises(ValueError, match=named):
        fl.predict(model, variables, DATA[0][0])
    with pytest.raises(ValueError, match=named):
        fl.models.trained(model, variables)
    # An nnx.State (as orbax restores one) is named as such, not blamed on x.
    as_restored = r"init_state: The given variables are an nnx.State .*pass the module itself"
    with pytest.raises(ValueError, match=as_restored):
        fl.trainer(model, SPARSE, "adam").run(DATA, nnx.state(model))
    with pytest.raises(ValueError, match=r"are an nnx.State .*nnx.update\(module, state\)"):
        fl.predict(model, nnx.state(model), DATA[0][0])
    np.testing.assert_array_equal(  # the fix the message names
        fl.predict(model, model, DATA[0][0]),
        fl.predict(model, fl.models.as_model(model).init(None, None), DATA[0][0]),
    )
    with pytest.raises(ValueError, match=r"an nnx.State .* nnx.update\(module, state\) .*is then"):
        fl.models.trained(model, nnx.state(model))

    class Counted(nnx.Module):  # a Variable holding a plain number, not an array
        def __init__(self, rngs):
            self.dense, self.count = nnx.Linear(5, 3, rngs=rngs), nnx.Variable(0)

        def __call__(self, x):
            return self.dense(x)

    assert fl.trainer(Counted(nnx.Rngs(0)), SPARSE, "adam").run(DATA).status == "completed"


def test_nnx_plain_bool_training_attribute():
    model = NnxOwnFlag(nnx.Rngs(0))
    adapter = fl.models.as_model(model)
    variables = adapter.init(None, None)
    x = DATA[0][0]
    y_train, _ = adapter.forward(variables, x, train=True, rng=None)
    np.testing.assert_allclose(
        np.asarray(y_train) - np.asarray(adapter.apply(variables, x)), 1.0, rtol=1e-5
    )


class EqxNet(eqx.Module):
    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.dense = eqx.nn.Linear(5, 16, key=k1)
        self.drop = eqx.nn.Dropout(0.5)
        self.out = eqx.nn.Linear(16, 3, key=k2)

    def __call__(self, x, key=None):
        return self.out(self.drop(jax.nn.relu(self.dense(x)), key=key))


def test_equinox_dropout_in_training_only():
    model = EqxNet(jax.random.PRNGKey(0))
    state = frozen_train_loss(model)
    evaluated = evaluator_with_loss(model).run(DATA, state.params)  # needed no key
    assert state.metrics["loss"] != pytest.approx(evaluated.metrics["loss"], rel=1e-3)
    loop = fl.trainer(model, SPARSE, "adam")  # one Loop, its fused and unfused programs
    fused, unfused = loop.run(DATA, epochs=2, fuse=2), loop.run(DATA, epochs=2)
    assert fused.history == unfused.history
    trained = fl.models.trained(model, unfused)
    assert trained.drop.inference is True
    np.testing.assert_allclose(
        np.asarray(jax.vmap(trained)(DATA[0][0])),
        np.asarray(fl.models.as_model(model).apply(unfused.params, DATA[0][0])),
        rtol=1e-6,
    )


class NnxFlagNet(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, deterministic: bool = False):
        return self.drop(self.dense(x), deterministic=deterministic)


def test_the_libraries_own_switch_to_training_wins_over_trained_evaluation():
    """Monte Carlo dropout: equinox's `inference_mode(m, False)` and nnx's `.train()` on
    the trained model put it in training mode; the flag `trained` passed for evaluation
    silently overrode them (the samples equalled the evaluation's)."""
    model = EqxInferenceFlag(jax.random.PRNGKey(0))  # its flag defaults to training
    state = fl.trainer(model, SPARSE, "sgd").run(DATA)
    evaluating = fl.models.trained(model, state)
    x, keys = DATA[0][0], jax.random.split(jax.random.PRNGKey(1), len(DATA[0][0]))
    evaluated = jax.vmap(evaluating)(x)
    sampling = eqx.nn.inference_mode(evaluating, False)
    sampled = jax.vmap(lambda xi, k: sampling(xi, key=k))(x, keys)
    by_flag = jax.vmap(lambda xi, k: evaluating(xi, key=k, inference=False))(x, keys)
    np.testing.assert_array_equal(sampled, by_flag)
    assert not np.array_equal(sampled, evaluated)
    np.testing.assert_array_equal(jax.vmap(eqx.nn.inference_mode(sampling))(x), evaluated)

    module = NnxFlagNet(nnx.Rngs(0))
    evaluating = fl.models.trained(module, fl.trainer(module, SPARSE, "sgd").run(DATA))
    evaluated = evaluating(x)
    for switch in (evaluating.train, lambda: evaluating.set_attributes(deterministic=False)):
        switch()
        assert not np.array_equal(evaluating(x), evaluated)
        evaluating.eval()
        np.testing.assert_array_equal(evaluating(x), evaluated)


class EqxBatchNorm(eqx.Module):
    dense: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.dense = eqx.nn.Linear(5, 3, key=key)
        self.norm = eqx.nn.BatchNorm(3, axis_name="batch")

    def __call__(self, x, state):
        return self.norm(self.dense(x), state)


def test_equinox_batchnorm_is_refused_by_name():
    model, _ = eqx.nn.make_with_state(EqxBatchNorm)(jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"eqx.nn.BatchNorm at model\.norm") as info:
        fl.trainer(model, SPARSE, "sgd").run(DATA)
    assert "shape" not in str(info.value)


def test_trained_linen_binds_and_evaluates():
    model = make_linen("training", True)
    state = fl.trainer(model, SPARSE, "adam").run(DATA, epochs=2)
    bound = fl.models.trained(model, state)
    expected = model.apply(state.params, DATA[0][0], training=False)
    np.testing.assert_array_equal(np.asarray(bound(DATA[0][0])), np.asarray(expected))
    # A flag without an evaluation default: the bound wrapper passes it.
    required = make_linen("deterministic", False)
    state = fl.trainer(required, SPARSE, "adam").run(DATA)
    wrapped = fl.models.trained(required, state.params)
    evaluated = np.asarray(required.apply(state.params, DATA[0][0], deterministic=True))
    np.testing.assert_array_equal(np.asarray(wrapped(DATA[0][0])), evaluated)
    # A flag defaulting to training is passed; given by position, it is the caller's.
    trains = _TrainsByDefault()
    state = fl.trainer(trains, SPARSE, "adam").run(DATA)
    wrapped = fl.models.trained(trains, state)
    evaluated = np.asarray(trains.apply(state.params, DATA[0][0], train=False))
    np.testing.assert_array_equal(np.asarray(wrapped(DATA[0][0])), evaluated)
    np.testing.assert_array_equal(np.asarray(wrapped(DATA[0][0], False)), evaluated)
    # It is the module, of its own class, fields and methods (an encoder's `encode`).
    assert isinstance(wrapped, _TrainsByDefault) and wrapped.width == 3
    encoded = trains.apply(state.params, DATA[0][0], method=_TrainsByDefault.encode)
    np.testing.assert_array_equal(np.asarray(wrapped.encode(DATA[0][0])), np.asarray(encoded))


class _TrainsByDefault(nn.Module):
    width: int = 3

    def setup(self):
        self.dense = nn.Dense(self.width)
        self.drop = nn.Dropout(0.5)

    def encode(self, x):
        return self.dense(x)

    def __call__(self, x, train: bool = True):
        return self.drop(self.encode(x), deterministic=not train)


@pytest.mark.parametrize("lift", [nn.remat, nn.jit])
def test_a_linen_module_lifted_whole_with_its_flag_static_trains_and_evaluates(lift):
    """nn.remat or nn.jit of the whole module, its flag among static_argnums: fuseloop
    passed the flag by keyword, which static_argnums does not cover, and the run failed
    blaming x (remat) or with JAX's TracerBoolConversionError (jit)."""
    lifted = lift(_TrainsByDefault, static_argnums=(2,))()
    runs = [fl.trainer(lifted, SPARSE, "adam").run(DATA, fuse=fuse) for fuse in (False, 2)]
    assert_tree_equal(runs[0].step_state, runs[1].step_state)
    evaluated = lifted.apply(runs[0].params, DATA[0][0], False)
    np.testing.assert_allclose(fl.predict(lifted, runs[0], DATA[0][0]), evaluated, atol=1e-6)
    trained = fl.models.trained(lifted, runs[0])  # its flag defaults to training: passed
    np.testing.assert_array_equal(trained(DATA[0][0]), evaluated)


class _ScaledTrainsByDefault(nn.Module):
    @nn.compact
    def __call__(self, x, scale: float = 1.0, train: bool = True):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(3)(x) * scale)


def test_a_lifted_linen_modules_flag_after_another_argument_goes_by_position():
    # The flag went by keyword unless right after x, so static_argnums=(3,) failed.
    lifted = nn.remat(_ScaledTrainsByDefault, static_argnums=(3,))()
    runs = [fl.trainer(lifted, SPARSE, "adam").run(DATA, fuse=fuse) for fuse in (False, 2)]
    assert_tree_equal(runs[0].step_state, runs[1].step_state)
    evaluated = lifted.apply(runs[0].params, DATA[0][0], 1.0, False)
    np.testing.assert_allclose(fl.predict(lifted, runs[0], DATA[0][0]), evaluated, atol=1e-6)
    trained = fl.models.trained(lifted, runs[0])
    np.testing.assert_array_equal(trained(DATA[0][0]), evaluated)


def test_trained_refuses_what_is_not_the_models_variables_when_called():
    # The params alone, a string or a custom loop's State failed later, inside flax.
    model = make_linen("training", True)
    state = fl.trainer(model, SPARSE, "adam").run(DATA)
    with pytest.raises(ValueError, match=r"the params alone, variables\['params'\]\?"):
        fl.models.trained(model, state.params["params"])
    with pytest.raises(ValueError, match=r"a str is not the variables of this model"):
        fl.models.trained(model, "checkpoint/")
    custom = fl.loop(lambda batch, s: {"n": s["n"] + 1}).run(DATA, {"n": jnp.int32(0)})
    with pytest.raises(ValueError, match=r"step_state has no 'params'"):
        fl.models.trained(model, custom)

    class Relu(nn.Module):  # no params: its variables are {}
        @nn.compact
        def __call__(self, x):
            return nn.relu(x)

    x = DATA[0][0]
    variables = Relu().init(jax.random.PRNGKey(0), x)
    np.testing.assert_array_equal(fl.models.trained(Relu(), variables)(x), np.maximum(x, 0))
    # An equinox module of other shapes: the State's params did not fit a tree's metadata.
    linear = eqx.nn.Linear(5, 3, key=jax.random.PRNGKey(0))
    state = fl.trainer(linear, SPARSE, "sgd").run(DATA)
    wider = eqx.nn.Linear(5, 4, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"bias of shape \(3,\) where the model makes \(4,\)"):
        fl.models.trained(wider, state)


@pytest.mark.parametrize("name", ["dropout_key", "noise_rng", "dropout_rngs"])
def test_plain_functions_with_a_key_under_another_name_are_named(name):
    """fuseloop passes the step's key to `rng`, `key`, ...; an apply_fn whose key is spelled
    otherwise kept its default, so its dropout was silently off (a warning: the name may
    mean something else), or failed inside the first step (refused: no default)."""
    namespace: dict = {}
    exec(f"def apply(p, x, {name}=None):\n    return x @ p['w']", namespace)
    exec(f"def needs(p, x, {name}):\n    return x @ p['w']", namespace)
    init = lambda rng, x: {"w": jnp.ones((5, 3))}  # noqa: E731
    said = rf"apply_fn's parameter '{name}' reads as a PRNG key"
    with pytest.warns(UserWarning, match=rf"{said}.*keeps its default \(dropout or noise off\)"):
        fl.models.from_functions(init, namespace["apply"])
    with pytest.raises(ValueError, match=said):
        fl.models.from_functions(init, namespace["needs"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rng gets the key; the others may mean anything
        fl.models.from_functions(init, lambda p, x, rng=None, noise_key=None, key_size=2: x)
        fl.models.from_functions(init, lambda p, x, cache_key=None, random_seed=0, **kw: x)
        model = nn.Dense(3)  # flax.linen's own apply takes rngs=None: a dict, not a key
        fl.models.from_functions(model.init, model.apply)


def test_a_linen_modules_own_apply_as_plain_functions_is_refused_where_it_would_mislead():
    """`from_functions(m.init, m.apply)` hides a linen module's train flag (its apply takes
    `*args, **kwargs`), so every step ran with the flag's default: dropout off and BatchNorm
    frozen, in silence. Refused, naming the fix; a module that asks for a dropout rng is
    named when it first runs. A flagless, rngless module still trains."""

    class Flagged(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(3)(nn.Dropout(0.5, deterministic=not train)(x))

    class AlwaysDrops(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.Dropout(0.5, deterministic=False)(x))

    said = r"apply_fn is {}\.apply, a flax\.linen module's own apply, {}.*Pass the module itself"
    flagged = Flagged()
    with pytest.raises(ValueError, match=said.format("Flagged", r".*flag 'train'")):
        fl.models.from_functions(flagged.init, flagged.apply)
    with pytest.raises(ValueError, match=said.format("Flagged", r".*flag 'train'")):
        fl.trainer((flagged.init, flagged.apply), SPARSE, "sgd")
    drops = AlwaysDrops()
    loop = fl.trainer((drops.init, drops.apply), SPARSE, "sgd")
    with pytest.raises(ValueError, match=said.format("AlwaysDrops", "to which fuseloop cannot")):
        loop.run(DATA)
    dense = nn.Dense(3)
    assert fl.trainer((dense.init, dense.apply), SPARSE, "sgd").run(DATA).status == "completed"


def test_trained_plain_functions():
    init = lambda rng, x: {"w": jnp.ones((5, 3))}  # noqa: E731
    apply = lambda p, x, train=False: x @ p["w"] + (1.0 if train else 0.0)  # noqa: E731
    state = fl.trainer((init, apply), SPARSE, optax.sgd(0.0)).run(DATA)
    model = fl.models.trained((init, apply), state)
    np.testing.assert_allclose(
        np.asarray(model(DATA[0][0])), DATA[0][0] @ np.ones((5, 3), np.float32), rtol=1e-6
    )


@pytest.mark.parametrize("flag", ["train", "is_training", "deterministic"])
def test_plain_functions_get_any_recognised_flag(flag):
    # Each spelling of fl.models.TRAIN_FLAGS reaches an apply_fn as it reaches a module:
    # True while training for `train` and `is_training` (haiku's), False for `deterministic`.
    seen = []

    def apply(p, x, **flags):
        seen.append(flags[flag])
        return x @ p["w"]

    apply.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("p", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY),
        ]
    )
    init = lambda rng, x: {"w": jnp.ones((5, 3))}  # noqa: E731
    state = fl.trainer((init, apply), SPARSE, optax.sgd(0.1)).run(DATA, fuse=False)
    training = fl.models.TRAIN_FLAGS[flag]
    assert training in seen  # the step (the run's checks also call it in evaluation mode)
    seen.clear()
    fl.predict((init, apply), state, DATA[0][0])
    assert set(seen) == {not training}


class EqxDropoutNoKey(eqx.Module):
    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self):
        self.dense = eqx.nn.Linear(5, 3, key=jax.random.PRNGKey(0))
        self.drop = eqx.nn.Dropout(0.5)

    def __call__(self, x):
        return self.drop(self.dense(x))


def test_equinox_dropout_without_a_key_argument_is_refused():
    with pytest.raises(ValueError, match=r"eqx.nn.Dropout \(at model\.drop\).*`key=None`"):
        fl.trainer(EqxDropoutNoKey(), SPARSE, "sgd")


class NnxCallFlag(nnx.Module):
    """Mode by a `__call__` flag (BatchNorm and Dropout told per call), not by `.train()`;
    `flag` names it, `train_value` is its value while training."""

    def __init__(self, rngs, flag: str):
        self.dense = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)
        self.flag = flag

    def __call__(self, x, train: bool = False, deterministic: bool = False):
        off = not train if self.flag == "train" else deterministic
        h = self.norm(self.dense(x), use_running_average=off)
        return self.out(self.drop(nnx.relu(h), deterministic=off))


@pytest.mark.parametrize("flag", ["train", "deterministic"])
def test_an_nnx_call_flag_switches_the_mode_as_linens_does(flag):
    model = NnxCallFlag(nnx.Rngs(0), flag)
    state = fl.trainer(model, SPARSE, optax.sgd(0.0)).run(DATA)  # trains in training mode
    assert not np.allclose(np.asarray(state.params["state"]["norm"]["mean"]), 0.0)
    evaluated = np.asarray(fl.predict(model, state, DATA[0][0]))
    eval_mode = {"train": False} if flag == "train" else {"deterministic": True}
    trained = fl.models.trained(model, state)
    expected = trained(jnp.asarray(DATA[0][0]), **eval_mode)
    np.testing.assert_array_equal(evaluated, np.asarray(expected))
    # Called as the docs say, without the flag, it evaluates too (its default would train
    # with deterministic=False), and it is still the user's module: its class, its state.
    np.testing.assert_array_equal(np.asarray(trained(jnp.asarray(DATA[0][0]))), expected)
    assert isinstance(trained, NnxCallFlag) and type(trained).__name__ == "NnxCallFlag"
    assert type(fl.models.trained(model, state)) is type(trained)  # one class: no recompile
    loaded = pickle.loads(pickle.dumps(trained))  # still evaluating once loaded
    np.testing.assert_array_equal(np.asarray(loaded(jnp.asarray(DATA[0][0]))), expected)
    own = NnxCallFlag(nnx.Rngs(1), flag)
    nnx.update(own, nnx.state(trained))  # as README.md writes the weights back
    np.testing.assert_array_equal(np.asarray(own(jnp.asarray(DATA[0][0]), **eval_mode)), expected)


class EqxInferenceFlag(eqx.Module):
    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self, key):
        self.dense = eqx.nn.Linear(5, 3, key=key)
        self.drop = eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key=None, inference: bool = False):
        return self.drop(self.dense(x), key=key, inference=inference)


def test_an_equinox_inference_argument_turns_dropout_off_in_evaluation():
    model = EqxInferenceFlag(jax.random.PRNGKey(0))
    state = fl.trainer(model, SPARSE, optax.sgd(0.0)).run(DATA)
    trained = fl.models.trained(model, state)
    expected = jax.vmap(lambda xi: trained(xi, inference=True))(jnp.asarray(DATA[0][0]))
    np.testing.assert_array_equal(np.asarray(fl.predict(model, state, DATA[0][0])), expected)
    # Without the flag too (its default, False, would run dropout), as the docs call it.
    np.testing.assert_array_equal(np.asarray(jax.vmap(trained)(jnp.asarray(DATA[0][0]))), expected)
    assert isinstance(trained, EqxInferenceFlag) and trained.dense is not None
    # It is still a model fuseloop takes with its State, and it pickles as an evaluating one.
    np.testing.assert_array_equal(np.asarray(fl.predict(trained, state, DATA[0][0])), expected)
    loaded = pickle.loads(pickle.dumps(trained))
    np.testing.assert_array_equal(np.asarray(jax.vmap(loaded)(jnp.asarray(DATA[0][0]))), expected)
    evaluated = evaluator_with_loss(model).run(DATA, state.params)
    assert state.metrics["loss"] != pytest.approx(evaluated.metrics["loss"], rel=1e-3)


class EqxTwoDropouts(eqx.Module):
    dense: eqx.nn.Linear
    first: eqx.nn.Dropout
    second: eqx.nn.Dropout

    def __call__(self, x, *, key=None):
        keys = (None, None) if key is None else jax.random.split(key)
        return self.dense(self.second(self.first(x, key=keys[0]), key=keys[1]))


def test_an_equinox_layer_set_to_inference_by_hand_is_named_when_a_trainer_takes_it():
    """A trainer runs its steps under eqx.nn.inference_mode(module, False), which turns a
    Dropout(p, inference=True) kept off by hand on, where a hand-written loop keeps it off:
    it warns, naming the layer. A module wholly in inference mode is switched in silence."""
    dense = eqx.nn.Linear(5, 3, key=jax.random.PRNGKey(0))
    model = EqxTwoDropouts(dense, eqx.nn.Dropout(0.5, inference=True), eqx.nn.Dropout(0.5))
    with pytest.warns(UserWarning, match=r"inference mode \(model\.first\) while others"):
        fl.trainer(model, SPARSE, "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(eqx.nn.inference_mode(model, True), SPARSE, "sgd")
        fl.trainer(eqx.nn.inference_mode(model, False), SPARSE, "sgd")


class NnxSowing(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        h = self.dense(x)
        self.sow(nnx.Intermediate, "h", h)  # for the user's own inspection, not state
        return h


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")
def test_what_an_nnx_module_sows_is_not_carried_as_state():
    fused, unfused = (
        fl.trainer(NnxSowing(nnx.Rngs(0)), SPARSE, optax.sgd(0.1)).run(DATA, epochs=2, fuse=k)
        for k in (2, False)
    )
    assert fused.params["state"] == {} and fused.history == unfused.history


class _AttentionBehindAFlagOfItsOwn(nn.Module):
    @nn.compact
    def __call__(self, x, is_train: bool = False):  # not a flag fuseloop recognises
        attention = nn.MultiHeadDotProductAttention(
            1, qkv_features=4, dropout_rate=0.5, deterministic=not is_train
        )
        return nn.Dense(3)(attention(x[:, None, :]).reshape(x.shape[0], -1))


def test_attention_dropout_behind_an_unrecognised_flag_is_refused_not_left_off():
    with pytest.raises(fl.models.ModelModeError, match=r"contains Dropout.*train_arg"):
        fl.trainer(_AttentionBehindAFlagOfItsOwn(), SPARSE, "adam").run(DATA)
    named = fl.models.linen(_AttentionBehindAFlagOfItsOwn(), train_arg="is_train", train_value=True)
    assert fl.trainer(named, SPARSE, "adam").run(DATA).status == "completed"


class _NoFlagNoise(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x + jax.random.normal(self.make_rng("noise"), x.shape))


class _PositionalOnlyFlag(nn.Module):
    @nn.compact
    def __call__(self, x, train=False, /):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(3)(x))


def test_a_model_needing_another_rng_stream_or_a_positional_only_flag_is_told_the_fix():
    with pytest.raises(ValueError, match=r"rng stream 'noise'.*passes only the 'dropout'"):
        fl.trainer(_NoFlagNoise(), SPARSE, "adam").run(DATA)
    with pytest.raises(ValueError, match=r"flag 'train' positional-only .*keyword argument"):
        fl.trainer(_PositionalOnlyFlag(), SPARSE, "adam").run(DATA)


class _SowsALoss(nn.Module):
    append: bool
    collection: str = "losses"

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(3)(x)
        keep = {} if self.append else {"init_fn": lambda: 0.0, "reduce_fn": lambda a, b: b}
        self.sow(self.collection, "l2", jnp.mean(h**2), **keep)
        return h


def test_sown_losses_are_said_to_be_outside_the_objective():
    with pytest.warns(UserWarning, match=r"'losses' collection .* not trained on.*fl\.loop"):
        fl.trainer(_SowsALoss(append=False), SPARSE, "adam").run(DATA)
    # flax's default reduce appends a value each step: the state grows, and is named.
    with pytest.raises(ValueError, match=r"\['losses'\]\['l2'\]\[1\] appears.*init_fn"):
        fl.trainer(_SowsALoss(append=True), SPARSE, "adam").run(DATA)
    # Into a collection of the user's own name too (the hint was for two names only).
    with pytest.raises(ValueError, match=r"\['metrics'\]\['l2'\]\[1\] appears.*init_fn"):
        fl.trainer(_SowsALoss(append=True, collection="metrics"), SPARSE, "adam").run(DATA)


class _SowsWhileTraining(nn.Module):
    collection: str = "monitor"

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(3)(x)
        if train:  # init (evaluation mode) makes no such collection
            self.sow(
                self.collection, "mean", h.mean(), init_fn=lambda: 0.0, reduce_fn=lambda a, b: b
            )
        return h


def test_a_value_sown_only_while_training_into_a_collection_init_did_not_make_is_refused():
    # flax dropped it in silence: the State held no such collection.
    with pytest.raises(ValueError, match=r"sows into \['monitor'\] while training.*train=True"):
        fl.trainer(_SowsWhileTraining(), SPARSE, "adam").run(DATA)
    for dropped in ("intermediates", "losses"):  # dropped as flax drops them
        state = fl.trainer(_SowsWhileTraining(dropped), SPARSE, "adam").run(DATA)
        assert list(state.params) == ["params"]


class _Probe(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.sow("probe", "mean", x.mean())
        return x


class _AppliesAnotherModuleInAThread(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        probe = lambda: _Probe().apply({}, np.ones(3), mutable=["probe"])  # noqa: E731
        thread = threading.Thread(target=probe)
        thread.start()  # while this module is traced: its sow is not this module's
        thread.join()
        return nn.Dense(3)(x)


class _AsksToWrite(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.is_mutable_collection("batch_stats")  # as flax's own layers ask before a write
        return x


class _FrozenWhileAnotherThreadAsks(nn.Module):
    """No flag, a frozen BatchNorm: its collection is read, never written."""

    @nn.compact
    def __call__(self, x):
        ask = lambda: _AsksToWrite().apply({}, np.ones(3), mutable=["batch_stats"])  # noqa: E731
        thread = threading.Thread(target=ask)
        thread.start()
        thread.join()
        return nn.BatchNorm(use_running_average=True)(nn.Dense(3)(x))


def test_a_sow_or_write_of_another_thread_while_a_model_is_traced_is_not_the_models():
    # The recording patches flax for the process: another thread's sow was refused as the
    # model's own, 5 times out of 5, and so was its question before a write.
    for model in (_AppliesAnotherModuleInAThread(), _FrozenWhileAnotherThreadAsks()):
        assert fl.trainer(model, SPARSE, "adam").run(DATA).status == "completed"


class _Normalised(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=not train)(x))


@pytest.mark.parametrize("fuse", [False, 2])
def test_frozen_variables_train_as_their_plain_dict_does(fuse):
    from flax.core import freeze

    variables = _Normalised().init(jax.random.PRNGKey(0), DATA[0][0])
    loop = fl.trainer(_Normalised(), SPARSE, "adam")
    plain = loop.run(DATA, variables, epochs=2, fuse=fuse)
    # Whole, or collection by collection (rebuilt from an older flax checkpoint's parts);
    # an OrderedDict is a plain dict's subclass, read as the plain dict too.
    collections = {name: freeze(c) for name, c in variables.items()}
    for given in (freeze(variables), collections, OrderedDict(variables)):
        frozen = loop.run(DATA, given, epochs=2, fuse=fuse)
        assert sorted(frozen.params) == ["batch_stats", "params"]
        assert_tree_equal(frozen.step_state, plain.step_state)


def test_a_seed_for_an_nnx_model_is_said_to_reach_nothing():
    # nnx's weights and dropout come from the nnx.Rngs the module was built with: seed=1
    # would train bitwise as seed=0 does, and a seed sweep would measure nothing.
    model = NnxCallFlag(nnx.Rngs(0), "train")
    with pytest.warns(UserWarning, match=r"seed=1 has no effect.*nnx.Rngs\(1\)"):
        fl.trainer(model, SPARSE, "sgd", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(model, SPARSE, "sgd")  # the default seed says nothing


class _SpectralNormed(nn.Module):
    """SpectralNorm's own flag as the module's only one (flax's `update_stats`)."""

    @nn.compact
    def __call__(self, x, update_stats: bool = False):
        h = nn.SpectralNorm(nn.Dense(8))(x, update_stats=update_stats)
        return nn.Dense(3)(nn.relu(h))


def test_spectral_norms_update_stats_flag_trains_its_power_iteration_as_a_plain_loop():
    """`update_stats` was no flag fuseloop knew: the module ran with its default (False)
    and trained with its spectral statistics frozen at init (sigma 1.0 where the plain
    loop's reached 1.8), without a word."""
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32))]
    model, tx = _SpectralNormed(), optax.sgd(0.1)
    variables = jax.jit(model.init)(jax.random.split(jax.random.PRNGKey(0))[0], data[0][0])
    params, stats, opt = variables["params"], variables["batch_stats"], tx.init(variables["params"])

    @jax.jit  # one program, not an eager compile per operation
    def plain_step(params, stats, opt, x, y):
        def objective(p):
            out, new = model.apply(
                {"params": p, "batch_stats": stats}, x, update_stats=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), new

        (_, new), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), new["batch_stats"], opt

    for x, y in data * 3:
        params, stats, opt = plain_step(params, stats, opt, x, y)
    state = fl.trainer(model, "sparse_categorical_cross_entropy", tx).run(data, epochs=3)
    assert_tree_close(state.params["batch_stats"], stats, rtol=1e-5)
    assert_tree_close(state.params["params"], params, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- flags of names fuseloop does not pass
class _NnxFlagged(nnx.Module):
    """BatchNorm and Dropout switched by a flag of a name fuseloop does not pass."""

    def __init__(self, default: bool, dropout: bool = True):
        rngs = nnx.Rngs(params=0, dropout=1)
        self.default, self.dense = default, nnx.Linear(5, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5 if dropout else 0.0, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, is_train: bool = False):
        h = self.bn(self.dense(x), use_running_average=not is_train)
        return self.head(self.drop(nnx.relu(h), deterministic=not is_train))


class _NnxFlaggedOn(_NnxFlagged):
    def __call__(self, x, is_train: bool = True):  # BatchNorm only (dropout=False)
        return self.head(nnx.relu(self.bn(self.dense(x), use_running_average=not is_train)))


class _EqxFlagged(eqx.Module):
    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self):
        self.dense, self.drop = eqx.nn.Linear(5, 3, key=jax.random.PRNGKey(0)), eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key=None, use_dropout: bool = False):
        return self.drop(self.dense(x), key=key, inference=not use_dropout)


class _EqxFlaggedOn(_EqxFlagged):
    def __call__(self, x, *, key, use_dropout: bool = True):
        return self.drop(self.dense(x), key=key, inference=not use_dropout)


class _EqxOtherFlag(_EqxFlagged):
    def __call__(self, x, *, key, logits: bool = True):  # a bool that is no mode flag
        y = self.drop(self.dense(x), key=key)
        return y if logits else jax.nn.softmax(y)


class _NnxFrozenNorm(_NnxFlagged):
    """Fine-tuning: BatchNorm frozen on purpose, a recognised flag for the Dropout, and a
    bool argument of another name that sets no layer's mode."""

    def __call__(self, x, train: bool = False, return_features: bool = False):
        h = self.drop(
            nnx.relu(self.bn(self.dense(x), use_running_average=True)), deterministic=not train
        )
        return h if return_features else self.head(h)


class _EqxBranchy(_EqxFlagged):
    aux: eqx.nn.Dropout = eqx.nn.Dropout(0.9)

    def __call__(self, x, *, key, with_aux: bool = False):  # aux runs only when asked
        y = self.drop(self.dense(x), key=key)
        return self.aux(y, key=key) if with_aux else y


def test_an_unrecognised_flag_that_keeps_layers_in_evaluation_while_training_is_refused():
    """The flag stayed at its default, so BatchNorm never updated and Dropout never
    dropped: a silently different model (linen refuses its own analogue)."""
    for model, flag, layers in (
        (_NnxFlagged(default=False), "is_train", "BatchNorm bn runs with use_running_average=True"),
        (_EqxFlagged(), "use_dropout", "Dropout drop runs with inference=True"),
    ):
        with pytest.raises(
            fl.models.ModelModeError, match=f"takes {flag}=False, .*training: {layers}"
        ):
            fl.trainer(model, SPARSE, "sgd").run(DATA)


def test_an_unrecognised_flag_that_keeps_layers_training_is_refused_when_evaluating():
    """Trained correctly (the default is the training value), then fl.predict normalised
    with each batch's statistics, or dropped: outputs that depend on the batch or a key."""
    x = DATA[0][0]
    for model, layers in (
        (
            _NnxFlaggedOn(default=True, dropout=False),
            "BatchNorm bn runs with use_running_average=False",
        ),
        (_EqxFlaggedOn(), "Dropout drop runs with inference=False"),
    ):
        state = fl.trainer(model, SPARSE, "sgd").run(DATA)
        with pytest.raises(fl.models.ModelModeError, match=f"out of evaluation: {layers}"):
            fl.predict(model, state, x)


@pytest.mark.parametrize("model", [_EqxOtherFlag(), _NnxFrozenNorm(default=False), _EqxBranchy()])
def test_a_bool_argument_that_sets_no_layers_mode_trains_and_evaluates_as_before(model):
    """Layers out of the mode that the flag does not set (a BatchNorm frozen for
    fine-tuning), or that only its other value calls, are the model's own choice."""
    loop = fl.trainer(model, SPARSE, "sgd").validate(model, DATA)
    state = loop.run(DATA, epochs=2)
    assert fl.predict(model, state, DATA[0][0]).shape == (8, 3)
    fused = loop.run(DATA, epochs=2, fuse=2)
    assert_tree_equal(fused.params, state.params)
    assert loop.run(DATA, epochs=2, fuse=2).stats["compiles"] == 0  # checked when traced only


class _NnxTwoFlags(_NnxFlagged):
    def __call__(self, x, is_train: bool = False, use_dropout: bool = False):
        h = nnx.relu(self.bn(self.dense(x)))
        return self.head(self.drop(h, deterministic=not (is_train and use_dropout)))


class _NnxAugmented(_NnxFlagged):
    def __call__(self, x, tta: bool = False):  # the frozen BatchNorm runs twice under tta
        h = self.bn(self.dense(x), use_running_average=True)
        if tta:
            h = (h + self.bn(self.dense(-x), use_running_average=True)) / 2
        return self.head(nnx.relu(h))


def test_flags_that_set_a_layer_together_are_flipped_together_and_a_call_count_is_no_mode():
    with pytest.raises(fl.models.ModelModeError, match="is_train=False, use_dropout=False, not"):
        fl.trainer(_NnxTwoFlags(default=False), SPARSE, "sgd").run(DATA)
    augmented = _NnxAugmented(default=False)
    assert fl.trainer(augmented, SPARSE, "sgd").run(DATA).status == "completed"
