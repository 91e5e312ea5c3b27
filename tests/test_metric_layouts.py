"""Built-in classification metrics on every output layout (one logit per example as (B,) or
(B, 1), multi-label under binary cross-entropy, multi-class), metric functions returning
per-example values, and metric names that validation would overwrite."""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl

RNG = np.random.default_rng(3)
X = RNG.normal(size=(40, 3)).astype(np.float32)
W = RNG.normal(size=(3, 4)).astype(np.float32)


def _linear(squeeze: bool = False) -> fl.models.from_functions:
    def apply(v, x):
        out = x @ v["w"]
        return out[:, 0] if squeeze else out

    return fl.models.from_functions(lambda rng, x: {"w": jnp.asarray(W)}, apply)


def _evaluate(model, loss, y, metrics, data=None):
    loop = fl.evaluator(model, loss)
    for metric in metrics:
        loop = loop.metric(metric)
    batches = data or [(X[:16], y[:16]), (X[16:32], y[16:32]), (X[32:], y[32:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the short last batch
        return loop.run(batches, {"w": jnp.asarray(W)}).metrics


def _binary_expected(logits, labels):
    predicted, true = logits > 0, labels > 0.5
    tp = np.sum(predicted & true)
    return {
        "accuracy": np.mean(predicted == true),
        "precision": tp / predicted.sum(),
        "recall": tp / true.sum(),
    }


def test_one_logit_per_example_of_shape_b_is_binary():
    labels = (X @ W[:, 0] + 0.3 * RNG.normal(size=40) > 0).astype(np.float32)
    got = _evaluate(
        _linear(squeeze=True), "binary_cross_entropy", labels, ["accuracy", "precision", "recall"]
    )
    expected = _binary_expected(X @ W[:, 0], labels)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name
    assert 0.5 < got["accuracy"] < 1.0  # neither all right nor read across the batch axis


def test_under_binary_cross_entropy_every_output_is_a_label_of_its_own():
    labels = (X @ W + RNG.normal(size=(40, 4)) > 0).astype(np.float32)  # multi-label
    got = _evaluate(_linear(), "binary_cross_entropy", labels, ["accuracy", "precision", "recall"])
    expected = _binary_expected(X @ W, labels)  # over every (example, label) element
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name


def _sequence_regressor() -> fl.models.from_functions:
    """Outputs (B, T=3, C=2) from x (B, 3, 4)."""
    w = RNG.normal(size=(4, 2)).astype(np.float32)
    return fl.models.from_functions(lambda rng, x: {"w": jnp.asarray(w)}, lambda v, x: x @ v["w"])


@functools.cache
def _sequence_trainer(loss: Any, metric: str | None) -> fl.Loop:
    """One trainer per (loss, metric), shared by its fused and unfused cases."""
    loop = fl.trainer(_sequence_regressor(), loss, "sgd")
    return loop if metric is None else loop.metric(metric)


@pytest.mark.parametrize("fuse", [False, 2])
@pytest.mark.parametrize(
    ("loss", "metric"),
    [
        ("mean_squared_error", None),
        ("mean_absolute_error", None),
        ("binary_cross_entropy", "accuracy"),
        (lambda y_true, y_pred: jnp.mean(y_pred**2), "mean_absolute_error"),
    ],
)
def test_targets_in_a_transposed_layout_are_refused_not_reshaped(loss, metric, fuse):
    """(B, C, T) targets hold as many values as a (B, T, C) output; reshaped, they trained
    on scrambled targets. Only trailing 1s are reshaped away."""
    x = RNG.normal(size=(16, 3, 4)).astype(np.float32)
    y = (RNG.normal(size=(16, 2, 3)) > 0).astype(np.float32)
    loop = _sequence_trainer(loss, metric)
    with pytest.raises(ValueError, match=r"y has shape \(8, 2, 3\).*output of shape \(8, 3, 2\)"):
        loop.run(fl.data.arrays(x, y, batch_size=8), epochs=1, fuse=fuse)
    y_column = (RNG.normal(size=(16, 3, 2, 1)) > 0).astype(np.float32)  # trailing 1: taken
    trained = loop.run(fl.data.arrays(x, y_column, batch_size=8), epochs=1, fuse=fuse)
    assert np.isfinite(trained.metrics["loss"])


def test_multi_class_precision_and_recall_are_micro_averaged():
    labels = RNG.integers(0, 4, size=40).astype(np.int32)
    got = _evaluate(
        _linear(), "sparse_categorical_cross_entropy", labels, ["accuracy", "precision", "recall"]
    )
    accuracy = np.mean(np.argmax(X @ W, -1) == labels)
    assert got["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    # One label per example: every example is one predicted and one actual positive.
    assert got["precision"] == got["recall"] == got["accuracy"]


def abs_error(y_true, y_pred):
    return jnp.abs(y_true - y_pred)[:, 0]  # one value per example


def batch_abs_error(y_true, y_pred):
    return jnp.mean(jnp.abs(y_true - y_pred))  # one scalar per batch


@functools.cache
def _abs_error_evaluator() -> fl.Loop:
    """Shared by the fuse modes below (the same programs, traced once)."""
    model = fl.models.from_functions(
        lambda rng, x: {"w": jnp.asarray(W[:, :1])}, lambda v, x: x @ v["w"]
    )
    return fl.evaluator(model, "mean_absolute_error").metric(abs_error).metric(batch_abs_error)


@pytest.mark.parametrize("fuse", [False, True, "run"])
def test_a_metric_function_of_per_example_values_is_a_mean_over_examples(fuse):
    y = (X @ W[:, :1]).astype(np.float32) + 1.0
    data = fl.data.arrays(X, y, batch_size=16, shuffle=False, drop_remainder=False, device=True)
    loop = _abs_error_evaluator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = loop.run(data, {"w": jnp.asarray(W[:, :1])}, fuse=fuse).metrics
    assert got["abs_error"] == pytest.approx(1.0, abs=1e-6)  # every example is off by 1
    assert got["abs_error"] == got["loss"]
    assert got["batch_abs_error"] == pytest.approx(1.0, abs=1e-6)


def test_a_training_metric_named_like_a_validation_metric_is_refused_in_either_order():
    model = fl.models.mlp([3])
    val = [(X[:8], RNG.integers(0, 3, 8).astype(np.int32))]
    score = lambda y_true, y_pred: jnp.float32(5.0)  # noqa: E731
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", "adam")
    with pytest.raises(ValueError, match=r"'validation_loss'.*validate\(\).*name="):
        loop.validate(model, val).metric(score, name="validation_loss")
    with pytest.raises(ValueError, match=r"'validation_loss'.*validate\(\).*name="):
        loop.metric(score, name="validation_loss").validate(model, val)
    # A name validation does not produce stays allowed.
    loop.metric(score, name="validation_score").validate(model, val)


def test_a_callable_loss_is_never_read_by_its_name():
    def binary_cross_entropy(y_true, y_pred):  # the user's own: -1/+1 labels, logistic
        return jnp.mean(jnp.logaddexp(0.0, -y_true * y_pred[:, 0]))

    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    y = np.where(x[:, 0] > 0, 1.0, -1.0).astype(np.float32)  # no built-in's labels
    loop = fl.trainer(fl.models.mlp([1]), binary_cross_entropy, "adam")
    assert loop.run([(x[:16], y[:16]), (x[16:], y[16:])]).status == "completed"


def test_same_rank_labels_that_are_not_one_per_example_are_refused_by_accuracy():
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    wide = np.eye(5, dtype=np.float32)[np.arange(16) % 5]  # one-hot of 5 classes, 3 outputs
    model = fl.models.mlp([3])
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)  # one compile, not op by op
    with pytest.raises(ValueError, match=r"y has shape \(16, 5\), but accuracy .* \(16, 3\)"):
        fl.evaluator(model).metric("accuracy").run([(x, wide)], variables)


@functools.cache
def _targets_and_outputs():
    """(B,) targets of a model whose output is (B, 1), its variables and the data (made
    once, in jit; the tests compare with a tolerance)."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = x[:, 0].copy()
    model = fl.models.mlp([1])
    return model, jax.jit(model.init)(jax.random.PRNGKey(0), x), x, y


def test_a_users_function_gets_targets_and_outputs_as_they_are_as_a_hand_loop_does():
    model, variables, x, y = _targets_and_outputs()
    mae = lambda t, p: jnp.abs(p[:, 0] - t)  # noqa: E731 - written for the shapes as they are
    state = fl.evaluator(model).metric(mae, name="mae").run([(x, y)], variables)
    out = np.asarray(jax.jit(model.apply)(variables, x))[:, 0]
    expected = np.mean(np.abs(out - y))
    assert state.metrics["mae"] == pytest.approx(float(expected), rel=1e-6)
    loss = lambda t, p: jnp.mean((p[:, 0] - t) ** 2)  # noqa: E731
    trained = fl.trainer(model, loss, "sgd").run([(x, y)], variables, fuse=False)
    expected = np.mean((out - y) ** 2)  # the loss of the variables before the step
    assert trained.history[0]["loss"] == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("kind", ["metric", "loss"])
def test_a_users_function_broadcasting_every_target_against_every_output_is_refused(kind):
    model, variables, x, y = _targets_and_outputs()
    crossed = lambda t, p: jnp.mean(jnp.abs(p - t))  # noqa: E731 - (16,) - (16, 1): (16, 16)
    if kind == "metric":
        loop = fl.evaluator(model).metric(crossed, name="mae")
    else:
        loop = fl.trainer(model, crossed, "sgd")
    message = rf"the {kind} .*y_true of shape \(16,\) and y_pred of shape \(16, 1\).*\(16, 16\)"
    with pytest.raises(ValueError, match=message):
        loop.run([(x, y)], variables)
    # The fix the message names (one evaluator for both cases).
    assert _fixed_mae_evaluator().run([(x, y)], variables).metrics


@functools.cache
def _fixed_mae_evaluator() -> fl.Loop:
    fixed = lambda t, p: jnp.mean(jnp.abs(p[..., 0] - t))  # noqa: E731
    return fl.evaluator(_targets_and_outputs()[0]).metric(fixed, name="mae")


@pytest.mark.parametrize("kind", ["metric", "loss"])
def test_a_multi_output_models_crossed_leaves_are_refused_by_name(kind):
    """A dict of outputs and a dict of targets: the (B,) against (B, 1) broadcast inside
    one output's term is refused as it is for plain arrays (it once trained on it)."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = {"reg": x[:, 0].copy(), "cls": (x[:, 1] > 0).astype(np.int32)}
    init = lambda rng, x: {"v": jnp.full((4, 1), 0.1), "c": jnp.zeros((4, 2))}  # noqa: E731
    model = fl.models.from_functions(init, lambda p, x: {"reg": x @ p["v"], "cls": x @ p["c"]})

    def crossed(t, p):  # (16,) - (16, 1): (16, 16)
        ce = optax.softmax_cross_entropy_with_integer_labels(p["cls"], t["cls"])
        return jnp.mean((p["reg"] - t["reg"]) ** 2) + jnp.mean(ce)

    def fixed(t, p):
        ce = optax.softmax_cross_entropy_with_integer_labels(p["cls"], t["cls"])
        return jnp.mean((p["reg"][..., 0] - t["reg"]) ** 2) + jnp.mean(ce)

    def attach(fn):
        if kind == "metric":
            return fl.trainer(model, fixed, "sgd").metric(fn, name="mse")
        return fl.trainer(model, fn, "sgd")

    message = rf"the {kind} .*y_true\['reg'\] of shape \(16,\) and y_pred\['reg'\] .*\(16, 16\)"
    with pytest.raises(ValueError, match=message):
        attach(crossed).run([(x, y)])
    assert attach(fixed).run([(x, y)]).status == "completed"


@pytest.mark.parametrize("layout", ["other_keys", "tuple_output"])
def test_crossed_leaves_at_different_places_are_refused_when_one_operation_reads_both(layout):
    """A target and an output at different places (keys "target" and "reg", or y_pred[0]
    against a plain y): the (B,) against (B, 1) broadcast once trained silently, to an MSE
    of 3.3 on a target the model fits exactly."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    init = lambda rng, x: {"v": jnp.full((4, 1), 0.1), "c": jnp.zeros((4, 2))}  # noqa: E731
    if layout == "other_keys":
        y, at, where = {"target": x[:, 0].copy()}, (lambda t: t["target"]), r"\['target'\]"
        model = fl.models.from_functions(init, lambda p, x: {"reg": x @ p["v"]})
        out, out_where = (lambda p: p["reg"]), r"\['reg'\]"
    else:
        y, at, where = x[:, 0].copy(), (lambda t: t), ""
        model = fl.models.from_functions(init, lambda p, x: (x @ p["v"], x @ p["c"]))
        out, out_where = (lambda p: p[0]), r"\[0\]"
    weights = jnp.linspace(0.5, 1.5, 16)  # an array the loss closes over
    crossed = lambda t, p: jnp.mean((out(p) - at(t)) ** 2 * weights)  # noqa: E731 - (16, 16)
    fixed = lambda t, p: jnp.mean((out(p)[:, 0] - at(t)) ** 2)  # noqa: E731
    message = rf"y_true{where} of shape \(16,\) and y_pred{out_where} of shape \(16, 1\)"
    with pytest.raises(ValueError, match=message + r".*\(16, 16\)"):
        fl.trainer(model, crossed, "sgd").run([(x, y)])
    assert fl.trainer(model, fixed, "sgd").run([(x, y)]).status == "completed"
    # A (B, B) array built from the outputs alone (a similarity matrix) is not a crossing.
    similarity = lambda t, p: fixed(t, p) + jnp.mean(out(p) * out(p).T)  # noqa: E731
    assert fl.trainer(model, similarity, "sgd").run([(x, y)]).status == "completed"


@pytest.mark.parametrize("metric", ["accuracy", "mae"])
def test_a_built_in_metric_of_a_dict_of_targets_and_weights_names_the_fix(metric):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = {"y": (x[:, 0] > 0).astype(np.int32), "w": np.ones(16, np.float32)}

    def weighted(y_true, logits):  # the user's own loss reads the dict
        each = optax.softmax_cross_entropy_with_integer_labels(logits, y_true["y"])
        return jnp.sum(each * y_true["w"]) / jnp.sum(y_true["w"])

    loop = fl.trainer(fl.models.mlp([2]), weighted, "sgd").metric(metric)
    message = r"takes y as one array of targets, .*y\['w'\] of shape \(16,\).* y_true\['y'\]"
    with pytest.raises(ValueError, match=message):
        loop.run([(x, y)])
    assert fl.trainer(fl.models.mlp([2]), weighted, "sgd").run([(x, y)]).status == "completed"


class LabelsAndWeights(NamedTuple):
    label: Any
    weight: Any = None


def test_a_named_tuple_of_targets_is_described_by_the_arrays_it_holds():
    """Its None field was counted as an array, and the fix read y_true[0]."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = LabelsAndWeights((x[:, 0] > 0).astype(np.int32))

    def loss(y_true, logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y_true.label).mean()

    loop = fl.trainer(fl.models.mlp([2]), loss, "sgd").metric("accuracy")
    message = r"y is a LabelsAndWeights of 1 array \(y.label of shape \(16,\)\).*y_true.label,"
    with pytest.raises(ValueError, match=message):
        loop.run([(x, y)])


def test_an_optax_loss_given_as_is_is_told_its_arguments_are_the_other_way_round():
    with pytest.raises(ValueError, match=r"optax's losses take \(predictions, targets\).*Wrap"):
        fl.trainer(fl.models.mlp([2]), optax.softmax_cross_entropy_with_integer_labels, "sgd")
    # The built-in named is the one the optax loss is, where there is one (it was always
    # the sparse cross-entropy).
    with pytest.raises(ValueError, match=r"the built-in 'binary_cross_entropy', which is"):
        fl.trainer(fl.models.mlp([3]), optax.sigmoid_binary_cross_entropy, "sgd")
    with pytest.raises(ValueError, match=r"\.mean\(\)$"):
        fl.trainer(fl.models.mlp([1]), optax.huber_loss, "sgd")
    # A metric's wrapper returns per-example values (a .mean() made it a mean of batches).
    per_example = r"optax.sigmoid_binary_cross_entropy\(y_pred, y_true\) \(one value per example"
    with pytest.raises(
        ValueError, match=r"metric=optax.sigmoid_binary_cross_entropy.*" + per_example
    ):
        fl.evaluator(fl.models.mlp([1])).metric(optax.sigmoid_binary_cross_entropy)
    with pytest.raises(ValueError, match=r"optax.losses.multiclass_hinge_loss\(y_pred, y_true\)"):
        fl.trainer(fl.models.mlp([2]), optax.losses.multiclass_hinge_loss, "sgd")
    # A partial of one was told its output is not a scalar; reduced, it trained swapped.
    with pytest.raises(ValueError, match=r"optax.sigmoid_focal_loss\(y_pred, y_true, gamma=2\)"):
        fl.trainer(fl.models.mlp([1]), functools.partial(optax.sigmoid_focal_loss, gamma=2), "sgd")


def test_a_pairwise_loss_and_metric_of_a_column_output_run_and_a_crossing_where_does_not():
    """A RankNet loss and a batch AUC squeeze the (B, 1) output, then build (B, B) from the
    outputs alone and from the targets alone: they were refused as a cross of (B,) targets
    against (B, 1) outputs, with a fix they had already applied. `jnp.where(t > 0, p, t)`
    broadcasts its operands before one select, and is a cross."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.normal(size=16) > 0).astype(np.float32)

    def ranknet(t, p):
        s = p[:, 0]
        order = jnp.sign(t[:, None] - t[None, :])
        return jnp.mean(jnp.abs(order) * jax.nn.softplus(-order * (s[:, None] - s[None, :])))

    def batch_auc(t, p):
        s = p[:, 0]
        pairs = (t[:, None] > 0.5) & (t[None, :] < 0.5)
        return jnp.sum((s[:, None] > s[None, :]) & pairs) / jnp.maximum(jnp.sum(pairs), 1)

    state = fl.trainer(fl.models.mlp([8, 1]), ranknet, "sgd").metric(batch_auc).run([(x, y)])
    s = np.asarray(fl.predict(fl.models.mlp([8, 1]), state, x))[:, 0]
    assert state.status == "completed" and 0 <= state.metrics["batch_auc"] <= 1
    assert np.isfinite(s).all()
    crossing = lambda t, p: jnp.mean(jnp.where(t > 0, p, t) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"y_true of shape \(16,\) and y_pred of shape \(16, 1\)"):
        fl.trainer(fl.models.mlp([8, 1]), crossing, "sgd").run([(x, y)])


def test_a_loss_and_metric_marked_pairwise_compare_every_target_with_every_prediction():
    # A retrieval score and a contrastive loss between predicted and target embeddings
    # broadcast one against the other on purpose: refused with no way out, while the same
    # metric written with a matmul ran.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 4))).astype(np.float32)

    def retrieval_at_1(t, p):
        distance = jnp.sum((p[:, None, :] - t[None, :, :]) ** 2, -1)
        return (jnp.argmin(distance, -1) == jnp.arange(t.shape[0])).astype(jnp.float32)

    def contrastive(t, p):
        logits = -jnp.sum((p[:, None, :] - t[None, :, :]) ** 2, -1)
        labels = jnp.arange(t.shape[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    model = fl.models.mlp([8, 4])
    with pytest.raises(ValueError, match=r"pass fl.pairwise\(retrieval_at_1\) instead"):
        fl.trainer(model, "mean_squared_error", "sgd").metric(retrieval_at_1).run([(x, y)])
    loop = fl.trainer(model, fl.pairwise(contrastive), "sgd").metric(fl.pairwise(retrieval_at_1))
    state = loop.run([(x, y)], epochs=2)
    p = np.asarray(fl.predict(model, state, x))
    nearest = np.argmin(((p[:, None, :] - y[None, :, :]) ** 2).sum(-1), -1)
    evaluated = fl.evaluator(model).metric(fl.pairwise(retrieval_at_1)).run([(x, y)], state)
    assert evaluated.metrics["retrieval_at_1"] == np.mean(nearest == np.arange(16))
    assert np.isfinite(state.metrics["loss"]) and "retrieval_at_1" in state.history[1]


@pytest.mark.parametrize("batch", [1, 6])
def test_a_time_step_distance_shaped_like_the_cross_at_this_batch_size_is_not_refused(batch):
    """(B, T) targets and a (B, T, 1) output broadcast to (B, B, T); a (B, T, T) distance
    between time steps has that shape where B is 1 (a ragged last batch) or T. Traced at
    another batch size it is no cross, so the loss trains; a true cross is still refused."""
    steps = 6
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, steps)).astype(np.float32)
    y = rng.normal(size=(batch, steps)).astype(np.float32)
    model = fl.models.from_functions(
        lambda rng, x: {"w": jnp.full((1,), 0.5)}, lambda p, x: x[..., None] * p["w"]
    )

    def chamfer(y_true, y_pred):  # every predicted step against every target step: (B, T, T)
        p = y_pred[..., 0]
        return jnp.mean(jnp.min((p[:, :, None] - y_true[:, None, :]) ** 2, axis=-1))

    def smoothness(y_true, y_pred):  # predictions alone: (B, T, T)
        p = y_pred[..., 0]
        return jnp.mean((p - y_true) ** 2) + jnp.mean((p[:, :, None] - p[:, None, :]) ** 2)

    for loss in (chamfer, smoothness):
        assert fl.trainer(model, loss, "sgd").run([(x, y)]).status == "completed"
    if batch == 1:  # (1, T, 1) - (1, T) crosses, and fails at any other batch size
        with pytest.raises(ValueError, match=r"broadcasts them to \(1, 6, 6\)"):
            fl.trainer(model, lambda t, p: jnp.mean((p - t) ** 2), "sgd").run([(x, y)])


def test_targets_spread_over_an_output_axis_as_long_as_the_batch_are_refused():
    """(B,) targets against a (B, H) output broadcast along H where H is the batch size:
    `p - t` compared every example's target with every prediction and trained without a
    word (at any other batch size it does not broadcast). Comparing each example's target
    with its own H outputs, or weighing classes by the batch's counts, where H is B by
    chance, still trains."""
    batch = 8
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 4)).astype(np.float32)
    model = fl.models.mlp([8, batch])
    spread = lambda t, p: jnp.mean((p - t) ** 2)  # noqa: E731
    # Where y_pred is a (B, B) score of every pair (an in-batch softmax), the fix is fl.pairwise.
    with pytest.raises(
        ValueError,
        match=r"broadcasts y_true's examples along an axis of y_pred.*"
        r"score for every pair of examples.*pass fl.pairwise\(<lambda>\) instead",
    ) as refused:
        fl.trainer(model, spread, "sgd").run([(x, x[:, 0])])
    assert str(refused.value).endswith("instead")  # not told, after, to reshape y

    def per_example(t, p):  # each example's target against each of its outputs
        return jnp.mean((p - t[:, None]) ** 2)

    def class_weighted(t, p):  # classes weighed by the batch's counts: (C,), here C is B
        counts = jnp.bincount(t, length=p.shape[-1]) + 1.0
        return -jnp.mean(
            jnp.sum(jax.nn.one_hot(t, p.shape[-1]) * jax.nn.log_softmax(p) / counts, -1)
        )

    def supervised_contrastive(t, p):  # a (B, B) term normalised by (B, 1) target counts
        same = (t[:, None] == t[None, :]).astype(p.dtype)
        logp = jax.nn.log_softmax(p @ p.T, axis=1)
        return -jnp.mean(same * logp / same.sum(1, keepdims=True))

    def row_weighted_logits(w, p):  # the model's own (B, B) logits, weighed per row
        return -jnp.mean(w[:, None] * jax.nn.log_softmax(p, 1) * jnp.eye(p.shape[0]))

    labels = np.arange(batch, dtype=np.int32) % 3
    for loss, y in (
        (per_example, x[:, 0]),
        (class_weighted, labels),
        (supervised_contrastive, labels),
        (row_weighted_logits, np.ones(batch, np.float32)),
    ):
        assert fl.trainer(model, loss, "sgd").run([(x, y)]).status == "completed", loss


@pytest.mark.parametrize("kind", ["metric", "loss"])
def test_weights_in_a_column_crossing_a_per_example_loss_inside_the_function_are_refused(kind):
    """Weights of (B, 1) (a DataFrame's column) times a per-example loss of (B,) make
    (B, B): no target leaf crosses the (B, C) output, so the check once let it through,
    and the loss trained as mean(w) * mean(l), the weights doing nothing."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    labels = (x[:, 0] > 0).astype(np.int32)
    model = fl.models.from_functions(
        lambda rng, x: {"c": jnp.zeros((4, 3))}, lambda p, x: x @ p["c"]
    )

    def weighted(column):
        def fn(t, p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(p, t["y"])
            weight = t["weight"] if column else t["weight"][..., 0]
            return jnp.mean(weight * per_example)

        return fn

    def supervised_contrastive(t, p):  # (B, B) from the targets and from the outputs alone
        same = (t["y"][:, None] == t["y"][None, :]).astype(p.dtype)
        logits = p @ p.T
        return jnp.mean(same * jax.nn.log_softmax(logits)) * jnp.mean(t["weight"])

    def attach(fn):
        if kind == "metric":
            return fl.trainer(model, weighted(False), "sgd").metric(fn, name="w")
        return fl.trainer(model, fn, "sgd")

    y = {"y": labels, "weight": np.ones((16, 1), np.float32)}
    message = (
        rf"the {kind} .*a value computed from y_true\['weight'\] against one computed "
        rf"from y_pred to \(16, 16\).*y_true\['weight'\]\[\.\.\., 0\]"
    )
    with pytest.raises(ValueError, match=message):
        attach(weighted(True)).run([(x, y)])
    assert attach(weighted(False)).run([(x, y)]).status == "completed"
    assert attach(supervised_contrastive).run([(x, y)]).status == "completed"


@pytest.mark.parametrize("scalar_in", ["y_pred", "y_pred (1,)", "y_true"])
def test_a_crossing_beside_a_scalar_output_or_target_is_refused(scalar_in):
    """One scalar leaf (an output's regulariser, a target's weight for the batch) has no
    batch axis, and the check stood aside for every leaf: a column of weights times a
    per-example loss trained as (B, B)."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    labels = (x[:, 0] > 0).astype(np.int32)

    def apply(p, x):
        logits = x @ p["c"]
        aux = 0.01 * jnp.mean(logits**2)  # a regulariser: () or (1,)
        aux = aux[None] if scalar_in == "y_pred (1,)" else aux
        return {"cls": logits, "aux": aux} if scalar_in.startswith("y_pred") else logits

    model = fl.models.from_functions(lambda rng, x: {"c": jnp.zeros((4, 3))}, apply)

    def weighted(column):
        def fn(t, p):
            logits = p["cls"] if scalar_in.startswith("y_pred") else p
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, t["y"])
            weight = t["weight"] if column else t["weight"][..., 0]
            extra = jnp.sum(p["aux"]) if scalar_in.startswith("y_pred") else t["alpha"]
            return jnp.mean(weight * per_example) + extra

        return fn

    y = {"y": labels, "weight": np.ones((16, 1), np.float32)}
    data = [(x, y if scalar_in.startswith("y_pred") else {**y, "alpha": np.float32(0.5)})]
    with pytest.raises(ValueError, match=r"y_true\['weight'\]\[\.\.\., 0\]"):
        fl.trainer(model, weighted(True), "sgd").run(data)
    assert fl.trainer(model, weighted(False), "sgd").run(data).status == "completed"


def test_the_reshape_the_refusal_suggests_drops_the_axis_of_one_on_the_side_holding_it():
    """y_true (B, 1) against a (B,) output leaf: the advice was `y_pred[..., 0]`, which
    turns (B,) into example 0's prediction alone, and trained in silence."""
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    loss = lambda t, p: jnp.mean((p["mean"] - t) ** 2)  # noqa: E731
    for shape, y, fix in (
        ((4,), x[:, :1], r"y_true\[\.\.\., 0\] or y_pred\['mean'\]\[\.\.\., None\]"),
        ((4, 1), x[:, 0], r"y_pred\['mean'\]\[\.\.\., 0\] or y_true\[\.\.\., None\]"),
    ):
        head = fl.models.from_functions(
            lambda rng, x, shape=shape: {"w": jnp.ones(shape)},
            lambda p, x: {"mean": x @ p["w"]},
        )
        with pytest.raises(ValueError, match=fix):
            fl.trainer(head, loss, "sgd").run([(x, y)])


def test_a_built_in_metric_of_one_target_against_several_outputs_is_told_to_pick_one():
    """A (B, 2) mean-and-log-variance head under "mae": reshaping y cannot help."""
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    nll = lambda t, p: jnp.mean(p[:, 1] + (t - p[:, 0]) ** 2 * jnp.exp(-p[:, 1]))  # noqa: E731
    loop = fl.trainer(fl.models.mlp([2]), nll, "sgd").metric("mae")
    with pytest.raises(ValueError, match=r"reads the one to compare \(y_pred\[:, 0\] against"):
        loop.run([(x, x[:, 0])])


def test_an_error_a_metric_function_raises_names_the_metric_and_what_it_got():
    """A metric written for a dict output, on a model returning one array: the error came
    with a note naming only the step (a loss's says what it got)."""
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    by_key = lambda t, p: jnp.mean(jnp.argmax(p["logits"], -1) == t)  # noqa: E731
    loss = "sparse_categorical_cross_entropy"
    loop = fl.trainer(fl.models.mlp([3]), loss, "sgd").metric(by_key, name="token_accuracy")
    with pytest.raises((TypeError, IndexError)) as raised:
        loop.run([(x, np.zeros(8, np.int32))])
    notes = "\n".join(raised.value.__notes__)
    assert "raised by the metric 'token_accuracy', called as fn(y_true, y_pred): " in notes
    assert "y_true of shape (8,), y_pred of shape (8, 3)" in notes
    shown = raised.value.__context__ is None or raised.value.__suppress_context__
    assert shown  # no second copy printed from a trace made to explain it
    # fuseloop's own cross-broadcast refusal names both already: no note repeats them.
    crossed = fl.trainer(fl.models.mlp([1]), "mse", "sgd").metric(lambda t, p: p - t, name="d")
    with pytest.raises(ValueError, match="broadcasts them") as raised:
        crossed.run([(x, np.zeros(8, np.float32))])
    assert "raised by the metric" not in "\n".join(getattr(raised.value, "__notes__", []))


class _Centroids(nn.Module):
    """k-means by gradient descent: the model's output is its 8 centroids, not one row per
    example, whatever the batch."""

    @nn.compact
    def __call__(self, x):
        return self.param("c", nn.initializers.normal(1.0), (8, 2))


def _distortion(y_true, centroids):
    return ((y_true[:, None, :] - centroids[None]) ** 2).sum(-1).min(-1).mean()


def _distortion_metric(y_true, centroids):
    return ((y_true[:, None, :] - centroids[None]) ** 2).sum(-1).min(-1)


def test_an_output_whose_rows_equal_the_batch_size_by_chance_is_no_cross():
    # A batch of 8 examples against 8 centroids was refused as every target against every
    # prediction (the centroids taken to follow the batch, at the other size too): from the
    # first batch, or mid-run at a ragged last batch of 8.
    x = np.random.default_rng(0).normal(size=(56, 2)).astype(np.float32)
    loop = fl.trainer(_Centroids(), _distortion, optax.adam(0.1)).metric(_distortion_metric)
    ragged = fl.data.arrays(x, x, batch_size=16, shuffle=False, drop_remainder=False)
    unfused = loop.run(ragged, epochs=2)
    resident = fl.data.arrays(x, x, 16, shuffle=False, drop_remainder=False, device=True)
    assert loop.run(resident, epochs=2, fuse=4).history == unfused.history
    assert loop.run(fl.data.arrays(x, x, batch_size=8), fuse=4).status == "completed"
    # A (B, 1) output against (B,) targets still crosses at every batch size, also beside
    # an output of 8 rows that does not follow the batch (review64).
    with pytest.raises(ValueError, match=r"every target against every prediction"):
        fl.trainer(fl.models.mlp([1]), lambda t, p: jnp.mean((p - t) ** 2), "sgd").run(
            [(x, x[:, 0])]
        )
    crossing = lambda t, p: jnp.mean((p["pred"] - t) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"every target against every prediction"):
        fl.trainer(fl.models.linen(_CentroidsAndHead()), crossing, "sgd").run(
            fl.data.arrays(x, x[:, 0], batch_size=8)
        )


class _CentroidsAndHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return {"centroids": _Centroids()(x), "pred": nn.Dense(1)(x)}
