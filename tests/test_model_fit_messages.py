"""The first-batch model checks blame what is wrong, not x (docs/reliability.md §1).

x is checked against the variables the run uses (an evaluator's params, a trainer's given
variables, `validate`'s trained params), not against what `model.init` would make; a model
returning several outputs is told that a built-in loss or metric reads one array; a model
asking for randomness fuseloop does not supply is told so, with the fix.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fuseloop as fl
from conftest import make_batches

SPARSE = "sparse_categorical_cross_entropy"
BATCH, FEATURES, CLASSES = 4, 3, 3

_rng = np.random.default_rng(0)
X = _rng.normal(size=(4 * BATCH, FEATURES)).astype(np.float32)
Y_REGRESSION = (X @ np.array([[1.0], [2.0], [3.0]], np.float32)).astype(np.float32)
Y_CLASSES = np.arange(4 * BATCH, dtype=np.int32) % CLASSES
REGRESSION = [(X[i : i + BATCH], Y_REGRESSION[i : i + BATCH]) for i in range(0, len(X), BATCH)]
CLASSIFICATION = [(X[i : i + BATCH], Y_CLASSES[i : i + BATCH]) for i in range(0, len(X), BATCH)]

PARAMS = {"w": np.full((FEATURES, 1), 0.5, np.float32), "b": np.ones((1,), np.float32)}


def apply(params: Any, x: Any) -> Any:
    return x @ params["w"] + params["b"]


def good_init(rng: Any, x: Any) -> Any:
    return {"w": jnp.zeros((x.shape[-1], 1)), "b": jnp.zeros((1,))}


def hand_mae(params: Any) -> float:
    """The mean absolute error over all examples of REGRESSION, on the host."""
    w, b = np.asarray(params["w"], np.float32), np.asarray(params["b"], np.float32)
    return float(np.mean(np.abs(X @ w + b - Y_REGRESSION)))


NO_VARIABLES = [lambda rng, x: None, lambda rng, x: {}]


def jit_init(model: Any, *args: Any, **flags: Any) -> Any:
    """`model.init(*args, **flags)` as one compiled program (eagerly, each op compiles)."""
    return jax.jit(functools.partial(model.init, **flags))(*args)


# --------------------------------------------------------------------------- given variables
@pytest.mark.parametrize("init", NO_VARIABLES, ids=["None", "empty"])
def test_evaluator_checks_x_with_the_given_params(init):
    state = fl.evaluator((init, apply)).metric("mean_absolute_error").run(REGRESSION, PARAMS)
    assert state.status == "completed"
    assert state.metrics["mean_absolute_error"] == pytest.approx(hand_mae(PARAMS), rel=1e-6)


def test_validate_checks_x_with_the_trained_params():
    loop = fl.trainer((good_init, apply), "mean_squared_error", optax.sgd(0.01))
    loop = loop.metric("mean_absolute_error").validate((lambda rng, x: {}, apply), REGRESSION)
    state = loop.run(REGRESSION, epochs=2)
    assert state.metrics["validation_mean_absolute_error"] == pytest.approx(
        hand_mae(state.params), rel=1e-5
    )


def test_a_trainer_started_from_given_variables_checks_x_with_them():
    loop = fl.trainer((lambda rng, x: {}, apply), "mean_squared_error", optax.sgd(0.0))
    state = loop.metric("mean_absolute_error").run(REGRESSION, PARAMS)
    assert state.status == "completed"
    assert state.metrics["mean_absolute_error"] == pytest.approx(hand_mae(PARAMS), rel=1e-6)


@pytest.mark.parametrize("init", NO_VARIABLES, ids=["None", "empty"])
def test_a_trainer_whose_init_returns_no_variables_blames_init(init):
    loop = fl.trainer((init, apply), "mean_squared_error", "sgd")
    with pytest.raises(ValueError, match=r"init returned (None|\{\}), no variables") as info:
        loop.run(REGRESSION)
    message = str(info.value)
    assert "x is not the problem" in message and "pass trained variables to run" in message


def test_an_evaluator_given_no_variables_names_them():
    with pytest.raises(ValueError, match=r"init_state: the given variables hold no arrays"):
        fl.evaluator((good_init, apply)).run(REGRESSION, {})


def test_labels_are_checked_when_only_the_given_params_know_the_classes():
    params = {"w": np.ones((FEATURES, CLASSES), np.float32)}
    data = list(CLASSIFICATION)
    data[0] = (data[0][0], np.array([0, 1, CLASSES + 2, 1], np.int32))
    loop = fl.evaluator((lambda rng, x: {}, lambda p, x: x @ p["w"]), SPARSE)
    with pytest.raises(ValueError, match=rf"y holds the label {CLASSES + 2}.*{CLASSES} classes"):
        loop.run(data, params)


# --------------------------------------------------------------------------- several outputs
class TupleOut(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        h = nn.Dense(4)(x)
        return nn.Dense(CLASSES)(h), h


class DictOut(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        h = nn.Dense(4)(x)
        return {"logits": nn.Dense(CLASSES)(h), "features": h}


@pytest.mark.parametrize(
    "model, kind", [(TupleOut(), "tuple"), (DictOut(), "dict")], ids=["tuple", "dict"]
)
def test_a_builtin_loss_on_several_outputs_says_so(model, kind):
    with pytest.raises(
        ValueError,
        match=rf"loss '{SPARSE}' takes one array of predictions, but the model returns a "
        rf"{kind} of 2 outputs.*custom loss, loss\(y_true, y_pred\), that picks the output"
        r".*or make the model return one array",
    ):
        fl.trainer(model, SPARSE, "sgd").run(CLASSIFICATION)


def test_several_targets_and_losses_per_output_name_the_one_function_that_reads_them():
    heads = [
        (x, {"logits": y, "features": np.zeros((len(y), 4), np.float32)}) for x, y in CLASSIFICATION
    ]
    with pytest.raises(ValueError, match=r"y_pred\['logits'\], against y_true\['logits'\]"):
        fl.trainer(DictOut(), SPARSE, "sgd").run(heads)

    def picks_the_output_only(y_true: Any, y_pred: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(y_pred["logits"], y_true).mean()

    with pytest.raises(
        ValueError, match=r"y holds targets y_true\['logits'\], y_true\['features'\]: does the loss"
    ):
        fl.trainer(DictOut(), picks_the_output_only, "sgd").run(heads)
    with pytest.raises(ValueError, match=r"Keras's losses per output are one function here"):
        fl.trainer(DictOut(), {"logits": SPARSE, "features": "mse"}, "sgd")


@pytest.mark.parametrize("metric", ["accuracy", "precision", "mean_squared_error"])
def test_a_builtin_metric_on_several_outputs_says_so(metric):
    def loss(y: Any, out: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(out[0], y).mean()

    loop = fl.trainer(TupleOut(), loss, "sgd").metric(metric)
    with pytest.raises(
        ValueError,
        match=rf"metric '{metric}' takes one array of predictions, but the model returns a "
        r"tuple of 2 outputs.*metric function that picks the output.*y_pred\[0\]",
    ):
        loop.run(CLASSIFICATION)


# --------------------------------------------------------------------------- rng streams
class NoiseRng(nn.Module):
    """Draws from a 'noise' stream while training: fuseloop passes only 'dropout'."""

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        h = nn.Dense(4)(x)
        if train:
            h = h + 0.1 * jax.random.normal(self.make_rng("noise"), h.shape)
        return nn.Dense(CLASSES)(h)


class AlwaysDropout(nn.Module):
    """Draws dropout masks in evaluation too: fuseloop evaluates without an rng."""

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(CLASSES)(x))


class DropNoRngs(nnx.Module):
    """An nnx Dropout built without rngs."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(FEATURES, CLASSES, rngs=rngs)
        self.dropout = nnx.Dropout(0.3)

    def __call__(self, x: Any) -> Any:
        return self.dropout(self.linear(x))


def test_a_linen_model_asking_for_another_rng_stream_is_told_so():
    with pytest.raises(
        ValueError,
        match=r"NoiseRng asks for the rng stream 'noise', but fuseloop's trainer passes only "
        r"the 'dropout' stream.*x is not the problem.*make_rng\('dropout'\).*fl\.loop",
    ) as info:
        fl.trainer(NoiseRng(), SPARSE, "sgd").run(CLASSIFICATION)
    assert "x does not fit" not in str(info.value)


def test_a_linen_model_drawing_randomness_in_evaluation_is_told_so():
    model = AlwaysDropout()
    params = jit_init(model, jax.random.PRNGKey(0), X[:BATCH])
    with pytest.raises(
        ValueError,
        match=r"AlwaysDropout asks for the rng stream 'dropout' in evaluation, but fuseloop "
        r"passes no rng when it evaluates.*deterministic=not train",
    ):
        fl.evaluator(model, SPARSE).run(CLASSIFICATION, params)


class NoisyInEval(nnx.Module):
    """Samples noise in every mode, from a stream of its own."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(FEATURES, CLASSES, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x: Any) -> Any:
        return self.linear(x) + jax.random.normal(self.rngs.noise(), (x.shape[0], CLASSES))


class DropoutUnderItsOwnFlag(nnx.Module):
    """Passes Dropout a mode flag whose name fuseloop does not know."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(FEATURES, CLASSES, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: Any, eval_mode: bool = False) -> Any:
        return self.dropout(self.linear(x), deterministic=eval_mode)


def test_an_nnx_model_drawing_randomness_in_evaluation_is_told_so():
    # Evaluation does not carry the Rngs from batch to batch: every batch drew the same
    # noise, and a Dropout kept on by an unknown flag validated in training mode.
    model = NoisyInEval(nnx.Rngs(params=0, noise=1))
    draws = r"NoisyInEval draws from its rng stream\(s\) 'noise' in evaluation.*in model \(No.*"
    draws += "same numbers"
    with pytest.raises(ValueError, match=draws):
        fl.predict(model, model, X, batch_size=BATCH)
    with pytest.raises(ValueError, match=draws):
        fl.evaluator(model, SPARSE).run(CLASSIFICATION, model)
    flagged = DropoutUnderItsOwnFlag(nnx.Rngs(params=0, dropout=1))
    loop = fl.trainer(flagged, SPARSE, "adam").validate(flagged, CLASSIFICATION)
    unknown = r"takes eval_mode=False, not a flag fuseloop passes.*deterministic=False"
    with pytest.raises(fl.models.ModelModeError, match=unknown):
        loop.run(CLASSIFICATION)
    assert fl.trainer(flagged, SPARSE, "adam").run(CLASSIFICATION).epoch == 0  # training is fine


class Recurrent(nnx.Module):
    """flax's nnx.RNN, which draws a key from its 'carry' stream at every call for an
    initial carry made of zeros: nothing reads what it draws."""

    def __init__(self, rngs: nnx.Rngs):
        self.rnn = nnx.RNN(nnx.GRUCell(1, 4, rngs=rngs))
        self.linear = nnx.Linear(4, CLASSES, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.linear(self.rnn(x[..., None])[:, -1])


class RandomCarry(nnx.Module):
    """An nnx.RNN whose cell draws its initial carry (`carry_init`) at every call."""

    def __init__(self, rngs: nnx.Rngs, carry_init: Any):
        cell = nnx.GRUCell(1, 4, carry_init=carry_init, rngs=rngs)
        self.rnn = nnx.RNN(cell, rngs=rngs)
        self.linear = nnx.Linear(4, CLASSES, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.linear(self.rnn(x[..., None])[:, -1])


def test_an_nnx_rnn_drawing_its_initial_carry_in_evaluation_names_the_layer_and_the_fix():
    with pytest.warns(UserWarning, match="carry_init"):  # flax's own, of its graphdefs
        model = RandomCarry(nnx.Rngs(0), nnx.initializers.normal(1.0))
    fix = r"in model\.rnn \(RNN\).*carry_init=nnx\.initializers\.zeros_init\(\)"
    with pytest.raises(fl.models.ModelConventionError, match=fix):
        fl.predict(model, model, X, batch_size=BATCH)
    with pytest.warns(UserWarning, match="carry_init"):
        fixed = RandomCarry(nnx.Rngs(0), nnx.initializers.zeros_init())
    assert fl.predict(fixed, fixed, X, batch_size=BATCH).shape == (len(X), CLASSES)


def test_an_nnx_model_whose_output_reads_none_of_its_evaluation_draws_evaluates():
    model = Recurrent(nnx.Rngs(0))
    state = fl.trainer(model, SPARSE, "adam").validate(model, CLASSIFICATION).run(CLASSIFICATION)
    trained = fl.models.trained(model, state)
    by_hand = nnx.jit(lambda module, x: module(x))(trained, X)  # eagerly: a compile per op
    np.testing.assert_allclose(fl.predict(model, state, X, batch_size=BATCH), by_hand, atol=1e-6)


def test_an_nnx_dropout_without_rngs_is_told_so():
    with pytest.raises(
        ValueError,
        match=r"DropNoRngs needs an rng it was not given.*x is not the problem.*give the layer "
        r"rngs=.*nnx\.Dropout\(0\.3, rngs=rngs\)",
    ) as info:
        fl.trainer(DropNoRngs(nnx.Rngs(0)), SPARSE, "sgd").run(CLASSIFICATION)
    assert "x does not fit" not in str(info.value)


def test_variables_of_another_model_are_named_with_the_leaf_that_differs():
    x, y = np.ones((16, 4), np.float32), np.zeros(16, np.int32)
    sparse = "sparse_categorical_cross_entropy"
    narrow = fl.trainer(fl.models.mlp([8, 3]), sparse, "adam").run([(x, y)])
    wide = fl.trainer(fl.models.mlp([16, 3]), sparse, "adam")
    with pytest.raises(ValueError, match=r"x does not fit the model with the given") as caught:
        wide.run([(x, y)], narrow, epochs=2)
    message = str(caught.value)
    assert "fresh variables fit this x" in message and "from another model" in message
    assert "of shape (8,) where the model makes (16,)" in message


def test_variables_given_without_their_params_wrapper_are_named_so():
    class Normed(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(3)(nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x)))

    x = np.random.default_rng(0).normal(size=(16, 5)).astype(np.float32)
    variables = jit_init(Normed(), jax.random.PRNGKey(0), x[:1])
    with pytest.raises(ValueError, match=r"variables\['params'\] alone: pass the whole"):
        fl.predict(Normed(), variables["params"], x)


def test_a_trainer_given_params_alone_for_a_model_without_a_train_flag_says_so():
    """Its layer names are no mutable collections: no train flag is missing."""
    x = np.zeros((8, 5), np.float32)
    model = fl.models.mlp([8, 3])
    params = jit_init(model, jax.random.PRNGKey(0), x)["params"]
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", "sgd")
    with pytest.raises(ValueError, match=r"^init_state: The given variables are the model's var"):
        loop.run([(x, np.zeros(8, np.int32))], params)


def test_an_equinox_module_written_for_a_batch_is_told_of_batched_and_it_trains():
    import equinox as eqx

    class WholeBatch(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):  # x: (batch, features), as a linen module takes it
            return jax.vmap(self.linear)(x)

    module = WholeBatch(eqx.nn.Linear(FEATURES, 1, key=jax.random.PRNGKey(0)))
    loss = "mean_squared_error"
    with pytest.raises(ValueError, match=r"from_equinox\(module, batched=True\)"):
        fl.trainer(module, loss, optax.sgd(0.1)).run(REGRESSION)
    batched = fl.models.from_equinox(module, batched=True)
    assert fl.trainer(batched, loss, optax.sgd(0.1)).run(REGRESSION).status == "completed"


def test_a_model_needing_a_second_argument_is_told_how_it_is_called():
    class TwoInputs(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(FEATURES, CLASSES, rngs=rngs)

        def __call__(self, x, mask):
            return self.linear(x) * mask

    with pytest.raises(ValueError, match=r"model\(x\).*gets only the x.*give the others"):
        fl.trainer(TwoInputs(nnx.Rngs(0)), SPARSE, optax.sgd(0.1)).run(CLASSIFICATION)


def test_a_module_handed_over_with_its_state_is_named_shortly_with_the_fix():
    import equinox as eqx

    big = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"nnx.split\(module\)'s parts") as split:
        fl.trainer(nnx.split(big), SPARSE, optax.sgd(0.1))
    assert len(str(split.value)) < 400  # not the repr of every weight
    pair = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    with pytest.raises(ValueError, match=r"eqx.nn.make_with_state.*not supported"):
        fl.trainer(pair, SPARSE, optax.sgd(0.1))
    module = fl.models.mlp([2])
    with pytest.raises(ValueError, match=r"model=\(MLP, dict\) is not a model") as linen_pair:
        fl.trainer((module, {"params": {}}), SPARSE, optax.sgd(0.1))
    assert "looks like" not in str(linen_pair.value)


def test_a_keras_model_is_told_its_pair_also_where_it_is_an_nnx_module():
    # Under KERAS_NNX_ENABLED=true a Keras model subclasses nnx.Module: it was adapted as
    # one and refused with "hold the weights in nnx.Param", a fix a Keras user cannot make.
    # Stand-ins of Keras's classes (keras is a benchmark extra, not a test dependency).
    plain = type("Sequential", (), {"__module__": "keras.src.models.sequential"})
    nnx_mode = type("Sequential", (nnx.Module,), {"__module__": "keras.src.models.sequential"})
    for model in (plain(), nnx_mode()):
        with pytest.raises(ValueError, match=r"A Keras model .*stateless_call.*fl\.loop"):
            fl.trainer(model, SPARSE, optax.sgd(0.1))


def test_an_x_of_another_dtype_than_the_weights_is_told_to_cast_not_reshape():
    def init(rng, x):
        return {"w": jax.random.normal(rng, (3, x.shape[1], 3, 3))}

    def apply(params, x):  # a plain convolution: lax wants one dtype
        y = jax.lax.conv_general_dilated(x, params["w"], (1, 1), "SAME")
        return y.mean((2, 3))

    x = np.zeros((4, 2, 8, 8), jnp.bfloat16)
    loop = fl.trainer(
        fl.models.from_functions(init, apply), "sparse_categorical_cross_entropy", "sgd"
    )
    with pytest.raises(ValueError, match=r"same dtypes.*Give x the dtype the model computes in"):
        loop.run([(x, np.zeros(4, np.int32))])


def test_object_and_string_data_are_told_their_dtype_and_the_fix_not_a_reshape():
    """A mixed pandas frame's `.values` (numbers as Python objects) or text failed with
    JAX's "not a valid dtype" and advice to give x or y another shape."""
    model = fl.models.from_functions(lambda rng, x: PARAMS, apply)
    x, y = X[:BATCH], Y_REGRESSION[:BATCH]
    cast = r"numbers held as Python objects .*: cast them, e.g. {}\.astype\(np\.float32\)$"
    with pytest.raises(ValueError, match=r"^data: x has dtype object, which no device hold"):
        fl.trainer(model, "mse", "sgd").run([(x.astype(object), y)])
    with pytest.raises(ValueError, match=r"^x has dtype object, .*" + cast.format("x")):
        fl.predict(model, PARAMS, x.astype(object))
    with pytest.raises(ValueError, match=r"^data: y has dtype object, .*" + cast.format("y")):
        fl.evaluator(model, "mse").run([(x, y.astype(object))], PARAMS)
    custom = lambda t, p: jnp.mean((p - t) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"y has dtype <U\d+, .*written as text: cast them"):
        fl.trainer(model, custom, "sgd").run([(x, y.astype(str))])
    words = np.array([["cat"], ["dog"]] * (BATCH // 2))
    with pytest.raises(ValueError, match=r"y has dtype <U3, .*np\.unique\(y, return_inverse"):
        fl.trainer(model, custom, "sgd").run([(x, words)])


class _EndsIn(nn.Module):
    """A Keras-style classifier whose last layer applies `final` (sigmoid or softmax)."""

    final: str
    outputs: int

    @nn.compact
    def __call__(self, x: Any) -> Any:
        return getattr(jax.nn, self.final)(nn.Dense(self.outputs)(nn.relu(nn.Dense(8)(x))))


@pytest.mark.parametrize(
    "final, outputs, loss",
    [
        ("sigmoid", 1, "binary_cross_entropy"),
        ("softmax", 3, "sparse_categorical_cross_entropy"),
    ],
)
def test_probability_outputs_under_a_logit_loss_are_warned_about_once(final, outputs, loss):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    data = [(x, np.zeros(16, np.int32))]
    loop = fl.trainer(_EndsIn(final, outputs), loss, "sgd").metric("accuracy")
    with pytest.warns(UserWarning, match=rf"look like probabilities.*applies {final} itself") as w:
        loop.run(data)
    # Accuracy thresholds one output per example as a logit; a class's argmax is the same
    # on probabilities, so the softmax warning does not say accuracy would suffer.
    said = str(next(x for x in w if "probabilities" in str(x.message)).message)
    assert ("'accuracy' would threshold" in said) is (final == "sigmoid")
    with warnings.catch_warnings():  # once per Loop: a second run does not check again
        warnings.simplefilter("error")
        loop.run(data)
    # A model that returns logits, as the built-in losses take: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(fl.models.mlp([8, outputs]), loss, "sgd").run(data)


def test_a_softmax_under_a_binary_cross_entropy_is_named_as_a_softmax():
    # It was called "a final sigmoid", and accuracy was named with no accuracy metric.
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    labels = (np.random.default_rng(1).random((16, 3)) < 0.3).astype(np.float32)
    loop = fl.trainer(_EndsIn("softmax", 3), "binary_cross_entropy", "sgd")
    with pytest.warns(UserWarning, match=r"final softmax.*sigmoid\(softmax.*compete") as w:
        loop.run([(x, labels)])
    assert not any("threshold" in str(x.message) for x in w)


@pytest.mark.parametrize("loss", ["sparse_categorical_cross_entropy", "categorical_cross_entropy"])
def test_a_sigmoid_under_a_categorical_cross_entropy_is_warned_about(loss):
    # Sigmoid outputs in (0, 1) taken as logits: the loss's softmax of them can never be
    # confident, and training went on without a word.
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    labels = np.arange(16) % 3
    y = (
        labels.astype(np.int32)
        if loss.startswith("sparse")
        else np.eye(3, dtype=np.float32)[labels]
    )
    loop = fl.trainer(_EndsIn("sigmoid", 3), loss, "sgd").metric("accuracy")
    said = r"final sigmoid\), .*softmax\(sigmoid\(\.\.\.\)\).*several labels.*binary_cross"
    with pytest.warns(UserWarning, match=said):
        loop.run([(x, y)])


def _probability_loss(y_true: Any, y_pred: Any) -> Any:
    p = jnp.clip(y_pred, 1e-7, 1 - 1e-7)
    return -jnp.mean(y_true * jnp.log(p) + (1 - y_true) * jnp.log(1 - p))


@pytest.mark.parametrize("loss", [_probability_loss, "mean_squared_error"])
def test_a_sigmoid_output_under_a_binary_metric_is_warned_about_by_trainer_and_evaluator(loss):
    # "accuracy" thresholds one output per example at 0 (a logit): on a sigmoid's
    # probabilities every prediction would be positive, and the metric silently the share
    # of positive labels.
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    data = [(x, (x[:, :1] > 0).astype(np.float32))]
    trainer = fl.trainer(_EndsIn("sigmoid", 1), loss, "sgd").metric("accuracy")
    own = r"p\.reshape\(y\.shape\) > 0\.5\) == \(y > 0\.5\), name='prob_accuracy'\) in place"
    with pytest.warns(UserWarning, match=r"a final sigmoid.*'accuracy'.*thresholded at 0.*" + own):
        state = trainer.run(data)
    evaluator = fl.evaluator(_EndsIn("sigmoid", 1)).metric("precision").metric("accuracy")
    with pytest.warns(UserWarning, match=r"metric\(s\) 'precision', 'accuracy' read one output"):
        evaluator.run(data, state.params)
    # Logits under a loss of one's own that takes them: nothing to say.
    logit_loss = lambda y, p: jnp.mean(optax.sigmoid_binary_cross_entropy(p, y))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(fl.models.mlp([8, 1]), logit_loss, "sgd").metric("accuracy").run(data)


def test_a_layers_output_is_logits_even_where_its_first_values_look_like_probabilities():
    # A dense layer ends the model: its outputs are logits whatever their values. Its
    # first outputs here (a zero kernel, a bias of 1/3) lie in (0, 1) and sum to 1 per
    # row, which running the model to look at them once took for a softmax's.
    model = nn.Dense(
        3, kernel_init=nn.initializers.zeros, bias_init=nn.initializers.constant(1 / 3)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(model, "sparse_categorical_cross_entropy", "sgd").run(make_batches(2))


def test_an_equinox_linear_ending_the_model_is_a_layer_too():
    # Under jax.vmap, equinox's `W @ x` becomes a dot_general and a transpose before the
    # bias: the transpose only moves values, so the output is still the layer's logits.
    eqx = pytest.importorskip("equinox")
    linear = eqx.nn.Linear(3, 3, key=jax.random.key(0))
    linear = eqx.tree_at(
        lambda m: (m.weight, m.bias), linear, (jnp.zeros((3, 3)), jnp.full((3,), 1 / 3))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(linear, "sparse_categorical_cross_entropy", "sgd").run(make_batches(2))


class _MixesProbabilities(nn.Module):
    """Ends in a layer over probabilities: softmax(h) @ T (a noise-transition layer)."""

    @nn.compact
    def __call__(self, x):
        return nn.softmax(nn.Dense(3)(x)) @ jnp.full((3, 3), 1 / 3)


def test_a_layer_over_probabilities_is_still_looked_at_and_warned_about():
    trainer = fl.trainer(_MixesProbabilities(), "sparse_categorical_cross_entropy", "sgd")
    with pytest.warns(UserWarning, match=r"outputs look like probabilities"):
        trainer.run(make_batches(2))


def test_a_sigmoid_written_by_hand_is_warned_about_not_a_crash():
    """`1 / (1 + exp(-h))`: the check that reads the model's last operation met the
    constant 1 (a jaxpr Literal, unhashable) and the run stopped with "unhashable type";
    a head `1 / (1 + softplus(h))` under a class metric did too."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    data = [(x, (x[:, :1] > 0).astype(np.float32))]
    init = lambda rng, x: {"w": jnp.full((4, 1), 0.1)}  # noqa: E731
    by_hand = fl.models.from_functions(init, lambda p, x: 1 / (1 + jnp.exp(-(x @ p["w"]))))
    with pytest.warns(UserWarning, match=r"look like probabilities"):
        fl.trainer(by_hand, "binary_cross_entropy", "sgd").run(data)
    head = fl.models.from_functions(init, lambda p, x: 1.0 / (1.0 + jax.nn.softplus(x @ p["w"])))
    loop = fl.trainer(head, _probability_loss, "sgd").metric("accuracy")
    assert loop.run(data).status == "completed"


def test_a_typo_in_a_loss_raises_its_own_error_not_a_data_misfit():
    """`jnp.meen` in a loss was reported as "data: y does not fit the loss ... Give y the
    shape the loss expects": the user was sent to their data for a bug in their code."""
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    data = [(x, np.zeros(8, np.int32))]
    typo = lambda y, p: jnp.meen(p)  # noqa: E731
    with pytest.raises(AttributeError, match="has no attribute 'meen'") as caught:
        fl.trainer(fl.models.mlp([3]), typo, "sgd").run(data)
    assert "raised by the loss '<lambda>' on the first batch" in caught.value.__notes__[-1]
    # Its own exceptions (a config dict's KeyError, a failed check) were re-raised as a
    # ValueError telling the user to reshape y: they keep their type, the shapes in a note.
    config: dict = {}
    own = lambda y, p: p.mean() * config["label_smoothing"]  # noqa: E731
    with pytest.raises(KeyError, match="label_smoothing") as caught:
        fl.trainer(fl.models.mlp([3]), own, "sgd").run(data)
    assert "with y (y of shape (8,)" in caught.value.__notes__[-1]

    def checked(y, p):
        raise RuntimeError("the loss's own check failed")

    with pytest.raises(RuntimeError, match="own check failed"):
        fl.trainer(fl.models.mlp([3]), checked, "sgd").run(data)
    # A KeyError of a dict y, or y read by an attribute it lacks, is y's misfit still: a
    # key y lacks is named with the keys it holds (a misspelt key is no matter of shape).
    targets = [(x, {"label": np.zeros(8, np.int32)})]
    by_key = lambda y, p: (p[:, 0] - y["target"]).mean()  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"the loss '<lambda>' reads a key 'target' where y does not hold it: y holds "
        r"y\['label'\] of shape \(8,\)\. Correct the key",
    ):
        fl.trainer(fl.models.mlp([3]), by_key, "sgd").run(targets)
    # A key y holds at another level is shown where it is.
    nested = [(x, {"label": np.zeros(8, np.int32), "aux": {"weight": np.ones(8, np.float32)}})]
    top = lambda y, p: (p[:, 0] * y["weight"]).mean()  # noqa: E731
    with pytest.raises(ValueError, match=r"reads a key 'weight' .* y\['aux'\]\['weight'\]"):
        fl.trainer(fl.models.mlp([3]), top, "sgd").run(nested)
    # ... but a KeyError of a key every dict of y holds comes from another dict: its own.
    options: dict = {}
    other_dict = lambda y, p: (p[:, 0] - y["label"]).mean() * options["label"]  # noqa: E731
    with pytest.raises(KeyError, match="label"):
        fl.trainer(fl.models.mlp([3]), other_dict, "sgd").run(targets)
    with pytest.raises(KeyError, match="label"):  # a dict deeper in y lacks it: no matter
        fl.trainer(fl.models.mlp([3]), other_dict, "sgd").run(nested)

    def unhashable(y, p):  # pandas raises KeyError of a list of missing columns
        raise KeyError(["a", "b"])

    with pytest.raises(KeyError, match=r"\['a', 'b'\]"):
        fl.trainer(fl.models.mlp([3]), unhashable, "sgd").run(targets)
    pair = [(x, (np.zeros(8, np.int32), np.ones(8, np.float32)))]
    by_name = lambda y, p: (p[:, 0] * y.weight).mean()  # noqa: E731
    with pytest.raises(ValueError, match=r"does not fit the loss .*AttributeError"):
        fl.trainer(fl.models.mlp([3]), by_name, "sgd").run(pair)
    # A typo of a method on an array (the output's or y's) is the loss's own.
    method = lambda y, p: (p - y[:, None]).meen()  # noqa: E731
    with pytest.raises(AttributeError, match="meen"):
        fl.trainer(fl.models.mlp([3]), method, "sgd").run(data)
    # A loss that reads y as what it is not is still the data's misfit.
    keyed = lambda y, p: y["w"].mean()  # noqa: E731
    with pytest.raises(ValueError, match=r"data: y does not fit the loss"):
        fl.trainer(fl.models.mlp([3]), keyed, "sgd").run(data)
    # numpy indexed by a traced y (class weights kept as an np.ndarray) is the loss's code:
    # jax's own error says to use jax.numpy, where "give y the shape" sent users to the data.
    weights = np.array([0.5, 1.0, 2.0], np.float32)
    weighted = lambda y, p: (weights[y] * p[:, 0]).mean()  # noqa: E731
    with pytest.raises(jax.errors.TracerArrayConversionError) as caught:
        fl.trainer(fl.models.mlp([3]), weighted, "sgd").run(data)
    assert "raised by the loss '<lambda>' on the first batch" in caught.value.__notes__[-1]


def test_a_value_shared_by_the_batch_in_y_is_named_with_the_loss_closure_as_the_fix():
    """Class weights of shape (7,) beside (4, 5) tokens in a dict y: the message said "x
    holds 4 examples but y holds 7" without saying which target, nor where such a value
    belongs."""
    x = np.zeros((4, 3), np.float32)
    y = {"tokens": np.zeros(4, np.int32), "class_weights": np.ones(7, np.float32)}
    message = (
        r"x holds 4 examples but y\['class_weights'\] \(shape \(7,\)\) holds 7; .*"
        r"belongs in the loss function, not in y: functools.partial\(my_loss, class_weights=w\)"
    )
    loss = lambda y, p: p.mean()  # noqa: E731
    with pytest.raises(ValueError, match=message):
        fl.trainer(fl.models.mlp([3]), loss, "sgd").run([(x, y)])
    # y of one array of another size is still told as it was: no leaf to name, no hint.
    with pytest.raises(ValueError, match=r"x holds 4 examples but y holds 7; x and y of a "):
        fl.trainer(fl.models.mlp([3]), loss, "sgd").run([(x, np.zeros(7, np.int32))])


class _SoftmaxIn(nn.Module):
    """A classifier ending in a softmax computed in `dtype`."""

    dtype: Any

    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.softmax(nn.Dense(10, dtype=self.dtype)(x))


@pytest.mark.parametrize("how", ["bf16", "population", "evaluator"])
def test_probability_outputs_are_warned_about_in_bf16_populations_and_evaluators(how):
    x = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
    data = [(x, np.arange(16, dtype=np.int32) % 10)]
    model = _SoftmaxIn(jnp.bfloat16 if how == "bf16" else jnp.float32)
    loss = "sparse_categorical_cross_entropy"
    with pytest.warns(UserWarning, match=r"look like probabilities.*applies softmax itself"):
        if how == "evaluator":
            fl.evaluator(model, loss).run(data, jit_init(model, jax.random.key(0), x))
        elif how == "population":
            fl.trainer(model, loss, "adam").run(data, population={"learning_rate": [0.1, 0.2]})
        else:
            fl.trainer(model, loss, "adam").run(data)


class _SyncedNorm(nn.Module):
    """A BatchNorm written for pmap: its statistics reduce over a named axis."""

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(nn.Dense(8)(x))
        return nn.Dense(3)(x)


def test_a_named_axis_collective_is_named_not_blamed_on_x():
    x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
    loop = fl.trainer(_SyncedNorm(), "sparse_categorical_cross_entropy", "sgd")
    with pytest.raises(ValueError, match=r"^model: it reduces over the named axis 'batch'.*Leave"):
        loop.run([(x, np.zeros(8, np.int32))])


class _DenseWithAFlag(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(CLASSES)(x)


def test_given_variables_the_model_does_not_make_are_warned_about():
    """A checkpoint holding a head the model drops ran in silence: flax ignores the extra
    entries, but the run carried them (optimizer state, weight decay, state.params). A
    resumed State and the trainer's own init are not warned about."""
    model = fl.models.mlp([8, CLASSES])
    loop = fl.trainer(model, SPARSE, optax.adamw(1e-2))
    variables = jit_init(model, jax.random.key(0), CLASSIFICATION[0][0])
    old_head = {"kernel": np.ones((8, 10), np.float32), "bias": np.ones(10, np.float32)}
    with_head = {"params": dict(variables["params"], Old_head=old_head)}
    said = r"given variables hold \['params'\]\['Old_head'\]\['bias'\] \(and 1 more\)"
    with pytest.warns(UserWarning, match=said + ".*weight decay shrinks them"):
        state = loop.run(CLASSIFICATION, with_head)
    assert "Old_head" in state.params["params"]
    # A collection beside 'params' is carried, not trained: the warning said it was.
    flagged = fl.trainer(_DenseWithAFlag(), SPARSE, optax.adamw(1e-2, weight_decay=0.5))
    plain = jit_init(_DenseWithAFlag(), jax.random.key(0), CLASSIFICATION[0][0])
    with_extra = {**plain, "extra": {"old": np.ones(4, np.float32)}}
    untrained = r"hold \['extra'\]\['old'\].*carries them unchanged \(they are not trained\)"
    with pytest.warns(UserWarning, match=untrained):
        kept = flagged.run(CLASSIFICATION, with_extra)
    np.testing.assert_array_equal(kept.params["extra"]["old"], np.ones(4, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.run(CLASSIFICATION, variables)
        loop.run(CLASSIFICATION)


class _StatsAlways(nn.Module):
    """A BatchNorm whose running average is never used: it writes batch_stats in evaluation."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=False)(x))


class _AuxHeadInTraining(nn.Module):
    """A head made only on the training path (an auxiliary loss's, say)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        out = nn.Dense(3)(x)
        return out + 0.1 * nn.Dense(3, name="aux")(x) if train else out


class _StringMode(nn.Module):
    @nn.compact
    def __call__(self, x, mode: str = "eval"):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=mode != "train")(x))


class _WritesParams(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        w = self.param("w", nn.initializers.ones, (x.shape[-1], 3))
        if train:
            self.put_variable("params", "w", w * 2)
        return x @ w


class _OptionalStringMode(nn.Module):
    @nn.compact
    def __call__(self, x, mode: str | None = None):
        return nn.Dense(3)(nn.BatchNorm(use_running_average=mode != "train")(x))


class _CounterInTraining(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        if train:  # a collection made only when training: the eval-mode init lacks it
            steps = self.variable("counter", "steps", lambda: jnp.zeros((), jnp.int32))
            steps.value += 1
        return nn.Dense(3)(x)


def test_a_collection_made_only_when_training_is_named_with_the_fix_that_runs():
    data = make_batches(2)
    with pytest.raises(
        ValueError, match=r"reads 'steps' of the collection 'counter' in /, which its init .*x is"
    ):
        fl.trainer(_CounterInTraining(), SPARSE, "sgd").run(data)
    variables = jit_init(_CounterInTraining(), jax.random.key(0), data[0][0], train=True)
    state = fl.trainer(_CounterInTraining(), SPARSE, "sgd").run(data, variables, epochs=2)
    assert int(state.params["counter"]["steps"]) == 1 + 4  # the init's step, then 4 steps


def test_linen_modules_breaking_the_train_flag_convention_are_told_so_not_blamed_on_x():
    data = make_batches(2)
    trained = fl.trainer(_StatsAlways(), SPARSE, "sgd").run(data)
    with pytest.raises(ValueError, match=r"updates 'batch_stats' .*when evaluated.*x is not the"):
        fl.evaluator(_StatsAlways()).run(data, trained)
    with pytest.raises(ValueError, match=r"writes 'params' .*in its forward pass.*x is not"):
        fl.trainer(_WritesParams(), SPARSE, "sgd").run(data)
    with pytest.raises(
        ValueError, match=r"parameter 'kernel' in /aux, which its init .*did not make.*x is not"
    ):
        fl.trainer(_AuxHeadInTraining(), SPARSE, "sgd").run(data)
    # The fix it names runs, and its variables are not called unread (the head trains).
    variables = jit_init(_AuxHeadInTraining(), jax.random.key(0), data[0][0], train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = fl.trainer(_AuxHeadInTraining(), SPARSE, "sgd").run(data, variables)
    assert not np.array_equal(
        state.params["params"]["aux"]["kernel"], variables["params"]["aux"]["kernel"]
    )
    for value in ("train", True):  # a str flag takes no bool: the wrapper is named
        with pytest.raises(ValueError, match=r"wrap the module"):
            fl.models.linen(_StringMode(), train_arg="mode", train_value=value)
    with pytest.raises(ValueError, match=r"takes a str .*wrap the module"):
        fl.models.linen(_OptionalStringMode(), train_arg="mode", train_value=True)


def test_a_model_collection_whose_dtype_the_step_changes_is_told_to_cast_it_back():
    class Counting(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            seen = self.variable("counters", "n", lambda: jnp.zeros((), jnp.int32))
            if train:
                seen.value = seen.value + 0.5  # int32 + 0.5 is float32
            return nn.Dense(3)(x)

    with pytest.raises(ValueError, match=r"'counters' collection.*cast the update back"):
        fl.trainer(Counting(), SPARSE, "sgd").run(make_batches(2))


def test_one_feature_per_example_without_its_axis_is_blamed_on_x_not_y():
    # A plain Dense reads x of shape (B,) as one example's B features: its output has no
    # axis of the batch, and the check of y against it named y instead.
    x = np.random.default_rng(0).normal(size=20).astype(np.float32)
    fix = r"x has shape \(5,\), one axis.*output of shape \(3,\).*x\[:, None\]"
    for loss, y in ((SPARSE, np.arange(20, dtype=np.int32) % 3), ("mse", np.ones((20, 3)))):
        with pytest.raises(ValueError, match=fix):
            fl.trainer(nn.Dense(3), loss, "sgd").run(fl.data.arrays(x, y, batch_size=5))
    # Token ids of shape (B,) embedded per example keep their batch axis: not refused.
    ids = np.arange(20, dtype=np.int32) % 7
    embedded = fl.trainer(nn.Embed(7, 3), SPARSE, "sgd").run(fl.data.arrays(ids, ids % 3, 5))
    assert embedded.status == "completed"
    # Nor is a model whose unbatched output its loss takes on purpose (the batch's NLL).
    fitted = fl.trainer(_BatchNll(), lambda y, nll: nll, "sgd").run(fl.data.arrays(x, x, 5))
    assert fitted.status == "completed"


def _mse(y_true, y_pred):
    return jnp.mean((y_true - y_pred) ** 2)


def test_a_custom_loss_broadcasting_an_unbatched_output_over_y_is_refused():
    # A custom loss broadcast Dense(1)'s one output, shape (1,), over the batch's 5 targets
    # and trained a wrong model in silence; the built-in loss was refused already.
    x = np.random.default_rng(0).normal(size=20).astype(np.float32)
    data = fl.data.arrays(x, 3 * x + 1, batch_size=5)
    fix = r"x has shape \(5,\), one axis.*loss '_mse'.*y of shape \(5,\).*x\[:, None\]"
    with pytest.raises(ValueError, match=fix):
        fl.trainer(nn.Dense(1), _mse, "sgd").run(data)
    with pytest.raises(ValueError, match=r"loss '_mse'.*x\[:, None\]"):
        fl.evaluator(nn.Dense(1), _mse).run(data, nn.Dense(1).init(jax.random.key(0), x[:5]))
    # With the feature axis it trains; so does a loss that never reads y (the model's own
    # loss terms, an output with an axis but not the examples').
    given = fl.data.arrays(x[:, None], 3 * x + 1, batch_size=5)
    assert fl.trainer(nn.Dense(1), lambda y, p: _mse(y, p[:, 0]), "sgd").run(given).status == (
        "completed"
    )
    for model, loss in (
        (_BatchTerms(), jax.jit(lambda y, t: t.sum())),  # the model's own loss terms
        (_Quantiles(), lambda y, q: jnp.mean(jnp.abs(q - y))),  # (3, B): the examples second
        (_Constant(), _mse),  # a baseline that reads no x
    ):
        assert fl.trainer(model, loss, "sgd").run(data).status == "completed"
    # y and the output as one-leaf trees, x as a dict of one leaf: the same broadcast.
    keyed = fl.data.arrays({"f": x}, {"t": 3 * x + 1}, batch_size=5)
    dense = fl.models.linen(_KeyedDense())
    with pytest.raises(ValueError, match=r"x\['f'\] has shape \(5,\).*x\['f'\]\[:, None\]"):
        fl.trainer(dense, lambda y, p: _mse(y["t"], p["p"]), "sgd").run(keyed)


class _Quantiles(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x[:, None]).T


class _Constant(nn.Module):
    @nn.compact
    def __call__(self, x):
        return self.param("c", nn.initializers.zeros, (1,))


class _KeyedDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return {"p": nn.Dense(1)(x["f"])}


class _BatchTerms(nn.Module):
    @nn.compact
    def __call__(self, x):
        mu = self.param("mu", nn.initializers.zeros, ())
        return jnp.stack([jnp.mean((x - mu) ** 2), mu**2])


class _BatchNll(nn.Module):
    @nn.compact
    def __call__(self, x):
        mu = self.param("mu", nn.initializers.zeros, ())
        return jnp.mean((x - mu) ** 2)


class _Decoding(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool, decode: bool):
        return nn.Dense(3)(x)


class _TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, a, b):
        return nn.Dense(3)(a + b)


def test_arguments_fuseloop_does_not_pass_are_named_not_blamed_on_xs_shape():
    """A required keyword-only `decode` beside the train flag was told as "Give x the
    shape the model expects"."""
    data = [(np.zeros((4, 6), np.float32), np.zeros(4, np.int32))]
    loss = "sparse_categorical_cross_entropy"
    with pytest.raises(
        ValueError,
        match=r"requires 'decode', which fuseloop does not pass.*"
        r"Give it a default \(decode=\.\.\.\)",
    ):
        fl.trainer(_Decoding(), loss, "sgd").run(data)
    with pytest.raises(ValueError, match=r"calls the model with x as one argument"):
        fl.trainer(_TwoInputs(), loss, "sgd").run(data)


# --------------------------------------------------------------------------- key arguments
def test_flaxs_rngs_argument_of_a_plain_apply_function_is_warned_of():
    """fuseloop passes one key, not flax's dict of streams: `rngs=None` would stay None,
    and a VAE sampling only when given it trained as a plain autoencoder."""
    with pytest.warns(UserWarning, match=r"'rngs' reads as a PRNG key.*\{'dropout': rng\}"):
        fl.models.from_functions(lambda r, x: PARAMS, lambda p, x, rngs=None: x @ p["w"])
    with warnings.catch_warnings():  # a linen module's own apply keeps its rngs handling
        warnings.simplefilter("error")
        module = nn.Dense(CLASSES)
        fl.models.from_functions(module.init, module.apply)


class _UndefinedName(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(CLASSES)(x) * undefined_scale  # type: ignore[name-defined]  # noqa: F821


class _NotCompact(nn.Module):
    def __call__(self, x: Any) -> Any:
        return nn.Dense(CLASSES)(x)


class _MisspeltLayer(nn.Module):
    def setup(self) -> None:
        self.dense = nn.Dense(CLASSES)

    def __call__(self, x: Any) -> Any:
        return self.dence(x)


class _MisspeltFunction(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return jnp.relu(nn.Dense(CLASSES)(x))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model", "raised"),
    [
        (_UndefinedName(), "NameError"),
        (_NotCompact(), "AssignSubModuleError"),
        (_MisspeltLayer(), "AttributeError"),
        (_MisspeltFunction(), "AttributeError"),
    ],
)
def test_a_bug_in_the_models_code_is_not_blamed_on_x(model: nn.Module, raised: str) -> None:
    with pytest.raises(ValueError, match=f"model: initializing it .* fails with {raised}") as got:
        fl.trainer(model, SPARSE, "sgd").run(CLASSIFICATION)
    assert "the model's own code" in str(got.value) and "does not fit" not in str(got.value)
    assert type(got.value.__cause__).__name__ == raised


def test_a_bug_in_the_models_code_is_named_when_evaluating_too() -> None:
    dense = nn.Sequential([nn.Dense(CLASSES)])  # {"params": {"layers_0": ...}}
    variables = {
        "params": {"Dense_0": jit_init(dense, jax.random.PRNGKey(0), X)["params"]["layers_0"]}
    }
    with pytest.raises(ValueError, match="model: applying .* AttributeError.* model's own code"):
        fl.evaluator(_MisspeltFunction()).run(CLASSIFICATION, variables)


class _ReadsAField(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(CLASSES)(x.image)


@flax.struct.dataclass
class _Batch:
    pixels: Any


def test_an_attribute_missing_from_x_still_says_x_does_not_fit() -> None:
    for make, kind in ((lambda x: {"pixels": x}, "dict"), (_Batch, "_Batch")):
        data = [(make(x), y) for x, y in CLASSIFICATION]
        with pytest.raises(ValueError, match=f"data: x does not fit the model.*'{kind}' object"):
            fl.trainer(_ReadsAField(), SPARSE, "sgd").run(data)


def test_a_function_models_variables_given_in_flaxs_wrapper_are_told_to_be_unwrapped() -> None:
    """Blamed on x, with a missing key named that was not the one the model read."""
    loop = fl.trainer((good_init, apply), "mean_squared_error", "sgd")
    with pytest.raises(ValueError, match=r"init_state: The given variables hold the model's own"):
        loop.run(REGRESSION, {"params": PARAMS})
    assert loop.run(REGRESSION, PARAMS).status == "completed"


class _Config(NamedTuple):
    scale: float


class _ReadsItsConfig(nn.Module):
    config: _Config = _Config(2.0)

    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(CLASSES)(x) * self.config.sacle  # type: ignore[attr-defined]


def test_a_typo_in_the_models_own_named_tuple_is_not_blamed_on_an_array_x() -> None:
    with pytest.raises(ValueError, match="'_Config' object has no .* the model's own code"):
        fl.trainer(_ReadsItsConfig(), SPARSE, "sgd").run(CLASSIFICATION)


class _OwnError(Exception):
    """An exception class of the user's (or of another library)."""


class _OwnValueError(ValueError):
    """A ValueError of the user's own, which fuseloop's checks must not take for theirs."""


class _Raises(nn.Module):
    error: type[Exception] = RuntimeError
    on_init: bool = True  # False: initializes, then raises when applied

    @nn.compact
    def __call__(self, x: Any) -> Any:
        y = nn.Dense(CLASSES)(x)
        if self.on_init or not self.is_initializing():
            raise self.error("the model's own check") from KeyError("width")
        return y


@pytest.mark.parametrize("error", [RuntimeError, NotImplementedError, _OwnError, _OwnValueError])
@pytest.mark.parametrize("on_init", [True, False])
def test_an_error_that_says_nothing_of_shapes_is_kept_as_the_model_raised_it(
    error: type[Exception], on_init: bool
) -> None:
    """Whether it is about x, fuseloop cannot tell: the error keeps its type, message and
    cause (a caller's `except` still catches it), noted with what fuseloop was doing; so
    does fl.predict's, raised once."""
    doing = "initializing it on" if on_init else "applying the model to"
    with pytest.raises(error) as got:
        fl.trainer(_Raises(error, on_init), SPARSE, "sgd").run(CLASSIFICATION)
    assert got.value.args == ("the model's own check",)
    assert f"while {doing} the first batch's x (x of shape (4, 3))" in " ".join(
        getattr(got.value, "__notes__", [])
    )
    assert repr(got.value.__cause__) == "KeyError('width')"
    variables = jit_init(nn.Dense(CLASSES), jax.random.PRNGKey(0), X)
    with pytest.raises(error) as got:
        fl.predict(_Raises(error, on_init), {"params": {"Dense_0": variables["params"]}}, X)
    assert got.value.__context__ is None and repr(got.value.__cause__) == "KeyError('width')"
    notes = getattr(got.value, "__notes__", [])
    assert sum("the model raised this while applying" in note for note in notes) == 1


def _unpacking_apply(params: Any, x: Any) -> Any:
    """Unpacks its kernel into two heads, raising a RuntimeError of its own (as einops's
    EinopsError is one) where the kernel's width is odd."""
    w = params["w"]
    if w.shape[1] % 2:
        raise RuntimeError(f"cannot unpack a kernel of width {w.shape[1]} into two heads")
    return (x @ w).reshape(x.shape[0], 2, -1).mean(axis=1)


def test_variables_at_fault_are_named_though_the_model_raises_a_runtime_error() -> None:
    model = fl.models.from_functions(
        lambda rng, x: {"w": jnp.ones((FEATURES, 6))}, _unpacking_apply
    )
    other = {"w": np.ones((FEATURES, 5), np.float32)}  # another model's: of width 5
    named = r"given variables .* hold \['w'\] of shape \(3, 5\) where the model makes \(3, 6\)"
    with pytest.raises(ValueError, match=named):
        fl.evaluator(model, SPARSE).run(CLASSIFICATION, other)
    with pytest.raises(ValueError, match=named):
        fl.trainer(model, SPARSE, "sgd").run(CLASSIFICATION, other)
