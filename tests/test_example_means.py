"""Built-in metrics and the loss are means over examples: a ragged last batch weighs by its
size. Fused and unfused runs still agree to the bit (sums and counts)."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from fuseloop._loop import Loop
from fuseloop._step import default_metrics, evaluator_program


def evaluator_with_loss(model, loss):
    """`fl.evaluator(model, loss=...)` (the factory builds exactly this Loop)."""
    if "loss" in inspect.signature(fl.evaluator).parameters:
        return fl.evaluator(model, loss=loss)
    program = evaluator_program(model, loss)
    return Loop(program, metrics=default_metrics(program))


def identity_model():
    return (lambda rng, x: {"b": jnp.zeros(())}, lambda p, x: x + p["b"])


def ragged(x, y, sizes):
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def test_mae_over_examples_not_batches():
    # The example: 10 examples in batches of 4, 4, 2; only the last two are off by 1.
    x = np.zeros((10, 1), np.float32)
    y = np.zeros((10, 1), np.float32)
    y[8:] = 1.0
    data = ragged(x, y, [4, 4, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = (
            fl.evaluator(identity_model())
            .metric("mean_absolute_error")
            .run(data, {"b": jnp.zeros(())})
        )
    assert state.metrics["mean_absolute_error"] == pytest.approx(0.2, abs=1e-7)


def _classifier_data(n=22, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=n).astype(np.int32)
    return x, y, fl.data.arrays(x, y, batch_size=batch, shuffle=False, drop_remainder=False)


def test_accuracy_and_loss_are_per_example_on_a_ragged_source():
    x, y, source = _classifier_data()
    model = fl.models.mlp([5, 3])
    variables = model.init(jax.random.PRNGKey(0), x[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = (
            evaluator_with_loss(model, "sparse_categorical_cross_entropy")
            .metric("accuracy")
            .run(source, variables)
        )
    logits = np.asarray(model.apply(variables, x))
    expected_acc = np.mean(np.argmax(logits, -1) == y)
    expected_loss = np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    assert state.metrics["accuracy"] == pytest.approx(expected_acc, abs=1e-7)
    assert state.metrics["loss"] == pytest.approx(float(expected_loss), rel=1e-6)


def test_trainer_loss_is_mean_over_examples():
    x, y, source = _classifier_data(n=20, batch=8)
    model = fl.models.mlp([3])
    variables = model.init(jax.random.PRNGKey(0), x[:2])
    # Learning rate 0: the params never change, so the epoch loss is the data's mean loss.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.0)).run(
            source, variables
        )
    logits = np.asarray(model.apply(variables, x))
    expected = np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    assert state.metrics["loss"] == pytest.approx(float(expected), rel=1e-6)


def test_callable_metric_keeps_per_batch_averaging():
    x = np.zeros((10, 1), np.float32)
    y = np.zeros((10, 1), np.float32)
    y[8:] = 1.0
    data = ragged(x, y, [4, 4, 2])

    def batch_mae(y_true, y_pred):
        return jnp.mean(jnp.abs(y_true - y_pred))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = fl.evaluator(identity_model()).metric(batch_mae).run(data, {"b": jnp.zeros(())})
    assert state.metrics["batch_mae"] == pytest.approx(1 / 3, abs=1e-7)


def test_precision_without_positives_reads_zero():
    x = -np.ones((6, 1), np.float32)
    y = np.ones((6, 1), np.float32)
    state = (
        fl.evaluator(identity_model())
        .metric("precision")
        .metric("recall")
        .run([(x[:3], y[:3]), (x[3:], y[3:])], {"b": jnp.zeros(())})
    )
    assert state.metrics["precision"] == 0.0
    assert state.metrics["recall"] == 0.0


@pytest.mark.parametrize("fuse", [2, True])
def test_fused_equals_unfused_bitwise_with_ragged_validation(fuse):
    _, _, train = _classifier_data(n=48, batch=8, seed=1)
    vx, vy, val = _classifier_data(n=21, batch=8, seed=2)
    model = fl.models.mlp([6, 3])

    def run(f):
        loop = (
            fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-2))
            .metric("accuracy")
            .metric("precision")
            .validate(model, val)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return loop.run(train, epochs=2, fuse=f)

    unfused, fused = run(False), run(fuse)
    assert unfused.history == fused.history
    logits = np.asarray(model.apply(unfused.params, vx))
    assert unfused.metrics["validation_accuracy"] == pytest.approx(
        np.mean(np.argmax(logits, -1) == vy), abs=1e-7
    )
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), unfused.params, fused.params)


def test_a_short_last_batch_warns_in_training_only():
    x, y, source = _classifier_data(n=20, batch=8)
    model = fl.models.mlp([3])
    variables = model.init(jax.random.PRNGKey(0), x[:2])
    # Evaluation data keeps its short batch (every example counts), as the README advises.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = fl.evaluator(model).metric("accuracy").run(source, variables)
    logits = np.asarray(model.apply(variables, x))
    assert state.metrics["accuracy"] == pytest.approx(np.mean(np.argmax(logits, -1) == y))
    with pytest.warns(UserWarning, match="batch size 4 instead of 8") as caught:
        fl.trainer(model, "sparse_categorical_cross_entropy", "sgd").run(source, variables)
    assert "drop_remainder=True" in " ".join(str(w.message) for w in caught)


def test_a_loss_without_targets_weighs_each_batch_by_its_inputs_rows():
    """An autoencoder's batches `(x, None)` have no y to count: the loss still averages
    over examples (25 rows in batches of 10, 10 and 5), as the same data with y=x does."""
    x = np.arange(75, dtype=np.float32).reshape(25, 3) / 75
    model = (lambda rng, x: {"w": jnp.eye(3)}, lambda p, x: x @ p["w"])
    variables = {"w": jnp.eye(3)}

    def energy(y_true, y_pred):  # needs no targets
        return jnp.mean(y_pred**2)

    def source(y):
        return fl.data.arrays(x, y, batch_size=10, shuffle=False, drop_remainder=False)

    expected = float(np.mean(x**2))
    for y in (None, x):
        state = evaluator_with_loss(model, energy).run(source(y), variables)
        assert state.metrics["loss"] == pytest.approx(expected, rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the short last training batch is warned of
        trained = (
            fl.trainer(model, energy, optax.sgd(0.0))
            .validate(model, source(None))
            .run(source(None), variables, epochs=1)
        )
    assert trained.metrics["loss"] == pytest.approx(expected, rel=1e-6)
    assert trained.metrics["validation_loss"] == pytest.approx(expected, rel=1e-6)
