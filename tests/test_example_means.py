"""Built-in metrics and the loss are means over examples: a ragged last batch weighs by its
size. Fused and unfused runs still agree to the bit (sums and counts)."""

from __future__ import annotations

import functools
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
            .run(data, {"b": np.zeros((), np.float32)})
        )
    assert state.metrics["mean_absolute_error"] == pytest.approx(0.2, abs=1e-7)


def _host_init(model, x, seed=0):
    """Variables in the shapes `model.init` gives, drawn on the host: they are only the runs'
    inputs, and an eager `model.init` compiles a program per op."""
    shapes = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x), x)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)


@functools.cache
def _reference(model):
    """The model's logits and per-example cross entropy, in one jitted program (eagerly,
    each op compiles its own); compared with the runs' metrics within a tolerance."""

    def reference(variables, x, y):
        logits = model.apply(variables, x)
        return logits, optax.softmax_cross_entropy_with_integer_labels(logits, y)

    return jax.jit(reference)


def _classifier_data(n=22, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=n).astype(np.int32)
    return x, y, fl.data.arrays(x, y, batch_size=batch, shuffle=False, drop_remainder=False)


def test_accuracy_and_loss_are_per_example_on_a_ragged_source():
    x, y, source = _classifier_data()
    model = fl.models.mlp([5, 3])
    variables = _host_init(model, x[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = (
            evaluator_with_loss(model, "sparse_categorical_cross_entropy")
            .metric("accuracy")
            .run(source, variables)
        )
    logits, losses = map(np.asarray, _reference(model)(variables, x, y))
    expected_acc = np.mean(np.argmax(logits, -1) == y)
    expected_loss = np.mean(losses)
    assert state.metrics["accuracy"] == pytest.approx(expected_acc, abs=1e-7)
    assert state.metrics["loss"] == pytest.approx(float(expected_loss), rel=1e-6)


def test_trainer_loss_is_mean_over_examples():
    x, y, source = _classifier_data(n=20, batch=8)
    model = fl.models.mlp([3])
    variables = _host_init(model, x[:2])
    # Learning rate 0: the params never change, so the epoch loss is the data's mean loss.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.0)).run(
            source, variables
        )
    expected = np.mean(np.asarray(_reference(model)(variables, x, y)[1]))
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
        state = (
            fl.evaluator(identity_model())
            .metric(batch_mae)
            .run(data, {"b": np.zeros((), np.float32)})
        )
    assert state.metrics["batch_mae"] == pytest.approx(1 / 3, abs=1e-7)


def test_precision_without_positives_reads_zero():
    x = -np.ones((6, 1), np.float32)
    y = np.ones((6, 1), np.float32)
    state = (
        fl.evaluator(identity_model())
        .metric("precision")
        .metric("recall")
        .run([(x[:3], y[:3]), (x[3:], y[3:])], {"b": np.zeros((), np.float32)})
    )
    assert state.metrics["precision"] == 0.0
    assert state.metrics["recall"] == 0.0


VALIDATED_MODEL = fl.models.mlp([6, 3])


@functools.cache
def _validated_loop():
    """One Loop for every run of the test below (fused and unfused, both fuse values): its
    programs are traced and lowered once."""
    _, _, val = _classifier_data(n=21, batch=8, seed=2)
    return (
        fl.trainer(VALIDATED_MODEL, "sparse_categorical_cross_entropy", optax.adam(1e-2))
        .metric("accuracy")
        .metric("precision")
        .validate(VALIDATED_MODEL, val)
    )


@pytest.mark.parametrize("fuse", [2, True])
def test_fused_equals_unfused_bitwise_with_ragged_validation(fuse):
    _, _, train = _classifier_data(n=48, batch=8, seed=1)
    vx, vy, _ = _classifier_data(n=21, batch=8, seed=2)
    model = VALIDATED_MODEL

    def run(f):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _validated_loop().run(train, epochs=2, fuse=f)

    unfused, fused = run(False), run(fuse)
    assert unfused.history == fused.history
    logits = np.asarray(_reference(model)(unfused.params, vx, vy)[0])
    assert unfused.metrics["validation_accuracy"] == pytest.approx(
        np.mean(np.argmax(logits, -1) == vy), abs=1e-7
    )
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), unfused.params, fused.params)


def test_a_short_last_batch_warns_in_training_only():
    x, y, source = _classifier_data(n=20, batch=8)
    model = fl.models.mlp([3])
    variables = _host_init(model, x[:2])
    # Evaluation data keeps its short batch (every example counts), as the README advises.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = fl.evaluator(model).metric("accuracy").run(source, variables)
    logits = np.asarray(_reference(model)(variables, x, y)[0])
    assert state.metrics["accuracy"] == pytest.approx(np.mean(np.argmax(logits, -1) == y))
    with pytest.warns(UserWarning, match="batch size 4 instead of 8") as caught:
        # The configuration of test_trainer_loss_is_mean_over_examples: its programs again.
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.0)).run(source, variables)
    assert "drop_remainder=True" in " ".join(str(w.message) for w in caught)


def test_a_loss_without_targets_weighs_each_batch_by_its_inputs_rows():
    """An autoencoder's batches `(x, None)` have no y to count: the loss still averages
    over examples (25 rows in batches of 10, 10 and 5), as the same data with y=x does."""
    x = np.arange(75, dtype=np.float32).reshape(25, 3) / 75
    model = (lambda rng, x: {"w": jnp.eye(3)}, lambda p, x: x @ p["w"])
    variables = {"w": np.eye(3, dtype=np.float32)}

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
