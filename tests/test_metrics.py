"""Metrics against hand computations: running averages and sums over an epoch's batches,
reset each epoch, visible to iteration handlers as of their iteration."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import CLASSES, make_batches, tiny_mlp, trainer

DATA = make_batches(6)


@pytest.fixture(scope="module")
def params():
    return tiny_mlp().init(jax.random.PRNGKey(1), DATA[0][0])


def running_average(values) -> float:
    """What the device accumulates: a float32 sum and count, divided on the host."""
    total = np.float32(0)
    for value in values:
        total = np.float32(total + np.float32(value))
    return float(total / np.float32(len(values)))


def batch_accuracies(params, data):
    out = []
    for x, y in data:
        logits = np.asarray(tiny_mlp().apply(params, x))
        out.append(np.mean((np.argmax(logits, -1) == y).astype(np.float32)))
    return out


def test_accuracy_is_the_running_average_of_batch_accuracies(params):
    seen: list = []
    loop = (
        fl.evaluator(tiny_mlp())
        .metric("accuracy")
        .handle_event("iteration_completed", lambda s: seen.append(s.metrics["accuracy"]))
    )
    state = loop.run(DATA, params)
    per_batch = batch_accuracies(params, DATA)
    assert state.metrics["accuracy"] == running_average(per_batch)
    assert isinstance(state.metrics["accuracy"], float)
    # Iteration handlers see the metric as of their own iteration.
    assert seen == [running_average(per_batch[: i + 1]) for i in range(len(DATA))]


def test_running_sum_and_reset_each_epoch():
    label_sum = lambda y_true, y_pred: jnp.sum(y_true)  # noqa: E731
    one = lambda y_true, y_pred: jnp.float32(1.0)  # noqa: E731
    seen: list = []
    loop = (
        fl.trainer(tiny_mlp(), "sparse_categorical_cross_entropy", "sgd")
        .metric(label_sum, name="labels", accumulate="running_sum")
        .metric(one, name="batches", accumulate="running_sum")
        .handle_event(
            "iteration_completed",
            lambda s: seen.append((s.epoch, s.iteration, s.metrics["batches"])),
        )
    )
    state = loop.run(DATA, epochs=3)
    expected = float(sum(int(y.sum()) for _, y in DATA))
    for epoch in range(3):
        assert state.history[epoch]["labels"] == expected
        assert state.history[epoch]["batches"] == float(len(DATA))
    assert seen == [(e, i, float(i + 1)) for e in range(3) for i in range(len(DATA))]


def test_trainer_loss_metric_matches_a_hand_written_optax_loop():
    model = tiny_mlp()
    variables = model.init(jax.random.PRNGKey(3), DATA[0][0])
    tx = optax.sgd(0.1)
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", tx).metric("accuracy")
    state = loop.run(DATA, variables, epochs=2)

    def loss_fn(p, x, y):
        logits = model.apply(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    p, opt_state = variables, tx.init(variables["params"])
    for epoch in range(2):
        losses, accs = [], []
        for x, y in DATA:
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, x, y)
            updates, opt_state = tx.update(grads["params"], opt_state, p["params"])
            p = {"params": optax.apply_updates(p["params"], updates)}
            losses.append(float(loss))
            accs.append(float(np.mean(np.argmax(np.asarray(logits), -1) == y)))
        np.testing.assert_allclose(state.history[epoch]["loss"], np.mean(losses), rtol=1e-5)
        assert state.history[epoch]["accuracy"] == pytest.approx(np.mean(accs), abs=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state.params, p
    )
    # The caller's variables were not donated or changed.
    assert np.isfinite(np.asarray(variables["params"]["Dense_0"]["kernel"])).all()


def _linear_pair(w, b):
    return (
        lambda rng, x: {"w": jnp.asarray(w), "b": jnp.asarray(b)},
        lambda p, x: x @ p["w"] + p["b"],
    )


@pytest.mark.parametrize("name", ["mean_squared_error", "mean_absolute_error"])
def test_regression_metrics(name):
    rng = np.random.default_rng(5)
    data = [
        (rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 1)).astype(np.float32))
        for _ in range(5)
    ]
    w = rng.normal(size=(3, 1)).astype(np.float32)
    b = np.zeros((1,), np.float32)
    model = _linear_pair(w, b)
    state = fl.evaluator(model).metric(name).run(data, {"w": w, "b": b})
    errors = [(x @ w + b) - y for x, y in data]
    if name == "mean_squared_error":
        per_batch = [np.mean(e**2) for e in errors]
    else:
        per_batch = [np.mean(np.abs(e)) for e in errors]
    np.testing.assert_allclose(state.metrics[name], np.mean(per_batch), rtol=1e-5)


@pytest.mark.parametrize("name", ["precision", "recall", "accuracy"])
def test_binary_classification_metrics(name):
    rng = np.random.default_rng(7)
    data = [
        (
            rng.normal(size=(8, 3)).astype(np.float32),
            rng.integers(0, 2, size=(8, 1)).astype(np.float32),
        )
        for _ in range(5)
    ]
    w = rng.normal(size=(3, 1)).astype(np.float32)
    b = np.full((1,), 0.1, np.float32)
    state = fl.evaluator(_linear_pair(w, b)).metric(name).run(data, {"w": w, "b": b})
    predicted = np.concatenate([(x @ w + b) > 0 for x, _ in data])
    true = np.concatenate([y > 0.5 for _, y in data])
    tp = np.sum(predicted & true)
    # Epoch values over all examples (precision and recall: over all positives), not means
    # of per-batch values.
    expected = {
        "precision": tp / predicted.sum(),
        "recall": tp / true.sum(),
        "accuracy": np.mean(predicted == true),
    }[name]
    np.testing.assert_allclose(state.metrics[name], expected, rtol=1e-6)


@pytest.mark.parametrize(
    "keras, ours",
    [
        ("sparse_categorical_crossentropy", "sparse_categorical_cross_entropy"),
        ("binary_crossentropy", "binary_cross_entropy"),
        ("mse", "mean_squared_error"),
    ],
)
def test_keras_spellings_train_as_our_names_and_keep_their_keys(keras, ours):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    if ours == "sparse_categorical_cross_entropy":
        model, y = tiny_mlp(), rng.integers(0, CLASSES, 16).astype(np.int32)
    else:  # one output: a binary logit or a regression value
        model, y = fl.models.mlp([8, 1]), rng.integers(0, 2, (16, 1)).astype(np.float32)
    data = [(x[:8], y[:8]), (x[8:], y[8:])]
    runs = [
        fl.trainer(model, loss, optax.sgd(0.1)).metric(metric).run(data, epochs=2, fuse=2)
        for loss, metric in ((keras, "acc"), (ours, "accuracy"))
    ]
    assert sorted(runs[0].metrics) == ["acc", "loss"]
    assert runs[0].metrics["acc"] == runs[1].metrics["accuracy"]
    assert runs[0].metrics["loss"] == runs[1].metrics["loss"]
    for a, b in zip(jax.tree.leaves(runs[0].params), jax.tree.leaves(runs[1].params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_unknown_loss_or_metric_lists_the_names_and_keras_spellings():
    with pytest.raises(ValueError, match=r"loss='xent' is not a known loss.*mse, mae"):
        fl.trainer(tiny_mlp(), "xent", optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"metric='f1' is not a known metric.*acc\)"):
        fl.evaluator(tiny_mlp()).metric("f1")


def test_callable_metric_and_custom_name(params):
    def top_class_rate(y_true, y_pred):
        return jnp.mean((jnp.argmax(y_pred, -1) == CLASSES - 1).astype(jnp.float32))

    loop = fl.evaluator(tiny_mlp()).metric(top_class_rate).metric("accuracy", name="acc")
    state = loop.run(DATA, params)
    assert set(state.metrics) == {"top_class_rate", "acc"}
    assert state.metrics["acc"] == running_average(batch_accuracies(params, DATA))
    rates = [
        np.mean(np.argmax(np.asarray(tiny_mlp().apply(params, x)), -1) == CLASSES - 1)
        for x, _ in DATA
    ]
    assert state.metrics["top_class_rate"] == running_average(rates)


def test_metric_names_must_be_unique():
    loop = fl.evaluator(tiny_mlp()).metric("accuracy")
    with pytest.raises(ValueError, match="accuracy"):
        loop.metric("accuracy")
    assert "acc2" in {m.name for m in loop.metric("accuracy", name="acc2").metrics}


def test_trainer_always_tracks_loss():
    state = fl.trainer(tiny_mlp(), "sparse_categorical_cross_entropy", optax.sgd(0.1)).run(DATA)
    assert set(state.metrics) == {"loss"}
    assert np.isfinite(state.metrics["loss"])
    # A named optimizer's learning rate can be read, so it is tracked too.
    named = fl.trainer(tiny_mlp(), "sparse_categorical_cross_entropy", "sgd").run(DATA)
    assert set(named.metrics) == {"loss", "learning_rate"}


@pytest.mark.parametrize("fuse", ["run", True])
def test_a_mean_over_a_long_epoch_does_not_drift(fuse):
    """100,000 steps of one example whose error is 0.7: a plain float32 running sum read
    0.69968 (every addition rounded the same way once the sum was large); the compensated
    sum reads the mean within a rounding."""
    n = 100_000
    x, y = np.full((n, 1), 0.7, np.float32), np.zeros((n, 1), np.float32)
    loop = fl.loop(lambda batch, state: {"y_pred": batch[0]}).metric("mean_absolute_error")
    data = fl.data.arrays(x, y, batch_size=1, shuffle=False, device=True)
    state = loop.run(data, {"y_pred": jnp.zeros((1, 1), jnp.float32)}, fuse=fuse)
    assert state.metrics["mean_absolute_error"] == pytest.approx(np.float32(0.7), rel=1e-7)


def test_a_second_built_in_metric_given_as_the_name_is_refused_not_used_as_a_key():
    # Keras's metrics=["accuracy", "mse"] split over .metric's two arguments: the accuracy
    # was kept under "mse".
    loop = trainer()
    with pytest.raises(ValueError, match=r"'mse' is another built-in metric.*\.metric\('mse'\)"):
        loop.metric("accuracy", "mse")
    with pytest.raises(ValueError, match=r"'accuracy' is another built-in metric"):
        loop.metric("mae", name="accuracy")
    # Its own Keras spelling, or a name of one's own, is a rename.
    assert loop.metric("accuracy", "acc").metrics[-1].name == "acc"
    assert loop.metric("accuracy", "top1").metrics[-1].name == "top1"
