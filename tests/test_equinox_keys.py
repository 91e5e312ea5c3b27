"""Keys for equinox modules (`fl.models.from_equinox`): a required `key` in evaluation, and
the one key per step a `batched=True` module gets in training."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import fuseloop as fl

eqx = pytest.importorskip("equinox")

SPARSE = "sparse_categorical_cross_entropy"
FEATURES, CLASSES = 3, 3
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(32, FEATURES)).astype(np.float32)
Y = _RNG.integers(0, CLASSES, 32).astype(np.int32)
DATA = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 32, 4)]  # 8 batches of 4


class KeywordOnlyKeyNet(eqx.Module):
    """Per example, `__call__(self, x, *, key)`: the key is required (common equinox style)."""

    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.dense = eqx.nn.Linear(FEATURES, 8, key=k1)
        self.drop = eqx.nn.Dropout(0.5)
        self.out = eqx.nn.Linear(8, CLASSES, key=k2)

    def __call__(self, x, *, key):
        return self.out(self.drop(jax.nn.relu(self.dense(x)), key=key))


class DefaultKeyMarksNet(eqx.Module):
    """Per example, `key=None`; adds 1 to its output whenever it is given a key."""

    dense: eqx.nn.Linear

    def __init__(self):
        self.dense = eqx.nn.Linear(FEATURES, CLASSES, key=jax.random.PRNGKey(0))

    def __call__(self, x, key=None):
        return self.dense(x) + (0.0 if key is None else 1.0)


class BatchedDropoutNet(eqx.Module):
    """The whole batch at once, `key=None` passed on to its Dropout."""

    w: jax.Array
    drop: eqx.nn.Dropout

    def __init__(self, key):
        self.w = jax.random.normal(key, (FEATURES, CLASSES)) * 0.1
        self.drop = eqx.nn.Dropout(0.5)

    def __call__(self, xb, key=None):
        return self.drop(xb, key=key) @ self.w


class BatchedRequiredKeyNet(BatchedDropoutNet):
    """The whole batch at once, `*, key` required."""

    def __call__(self, xb, *, key):
        return self.drop(xb, key=key) @ self.w


def _leaves_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for left, right in zip(leaves_a, leaves_b, strict=True):
        assert np.array_equal(np.asarray(left), np.asarray(right))


@pytest.fixture(scope="module")
def keyword_only():
    """The module, its trainer (one Loop for the fused and unfused runs: traced once) and
    its unfused two-epoch run."""
    module = KeywordOnlyKeyNet(jax.random.PRNGKey(0))
    loop = fl.trainer(module, SPARSE, "adam")
    return module, loop, loop.run(DATA, epochs=2)


def test_required_keyword_only_key_module_evaluates_with_predict_evaluator_and_validate(
    keyword_only,
):
    module, loop, state = keyword_only
    assert fl.predict(module, state, X).shape == (32, CLASSES)
    evaluated = fl.evaluator(module, SPARSE).run(DATA, state)
    assert np.isfinite(evaluated.metrics["loss"])
    validated = loop.validate(module, DATA).run(DATA, epochs=1)
    assert np.isfinite(validated.metrics["validation_loss"])


def test_required_keyword_only_key_module_trains_fused_bitwise_equal_to_unfused(keyword_only):
    _, loop, unfused = keyword_only
    fused = loop.run(DATA, epochs=2, fuse=4)
    _leaves_equal(fused.step_state, unfused.step_state)
    assert fused.history == unfused.history


def test_required_key_predict_equals_the_trained_module_vmapped_in_inference_mode(
    keyword_only,
):
    module, _, state = keyword_only
    trained = fl.models.trained(module, state)
    assert trained.drop.inference is True
    # One jitted program for both keys (eagerly, each op compiles its own).
    batched = eqx.filter_jit(lambda m, key: jax.vmap(lambda xi: m(xi, key=key))(X))
    expected = batched(trained, jax.random.PRNGKey(0))
    # Equal up to float rounding: predict runs jitted, batch by batch.
    np.testing.assert_allclose(
        np.asarray(fl.predict(module, state, X)), expected, rtol=1e-5, atol=1e-6
    )
    # In inference mode the key cannot change the output: Dropout ignores it.
    other_key = batched(trained, jax.random.PRNGKey(7))
    assert np.array_equal(np.asarray(expected), np.asarray(other_key))


def test_a_default_key_module_is_still_evaluated_without_a_key():
    module = DefaultKeyMarksNet()
    adapter = fl.models.from_equinox(module)
    variables = adapter.init(None, None)
    without_key = np.asarray(jax.vmap(module)(X))  # key=None: no mark
    np.testing.assert_allclose(np.asarray(adapter.apply(variables, X)), without_key, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fl.predict(module, variables, X)), without_key, rtol=1e-6)


def test_unbatched_training_splits_the_step_key_into_one_key_per_example():
    module = KeywordOnlyKeyNet(jax.random.PRNGKey(0))
    adapter = fl.models.from_equinox(module)
    rng = jax.random.PRNGKey(3)
    y, _ = adapter.forward(adapter.init(None, None), X[:4], train=True, rng=rng)
    keys = jax.random.split(rng, 4)
    in_training = eqx.nn.inference_mode(module, False)
    expected = jax.vmap(lambda xi, k: in_training(xi, key=k))(X[:4], keys)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))


class DictInputKeyNet(KeywordOnlyKeyNet):
    """The same network on an input dict {"a": (1,), "b": (2,)} per example."""

    def __call__(self, x, *, key):
        return super().__call__(jax.numpy.concatenate([x["a"], x["b"]]), key=key)


def test_a_dict_input_gets_one_key_per_example_and_trains_fused_as_unfused():
    """The batch size for the per-example keys comes from x's first leaf: x.shape failed on
    a dict, and the error blamed x."""
    module = DictInputKeyNet(jax.random.PRNGKey(0))
    adapter = fl.models.from_equinox(module)
    x = {"a": X[:, :1], "b": X[:, 1:]}
    rng = jax.random.PRNGKey(3)
    first = jax.tree.map(lambda a: a[:4], x)
    y, _ = adapter.forward(adapter.init(None, None), first, train=True, rng=rng)
    in_training = eqx.nn.inference_mode(module, False)
    expected = jax.vmap(lambda xi, k: in_training(xi, key=k))(first, jax.random.split(rng, 4))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
    data = fl.data.arrays(x, Y, batch_size=4, shuffle=False)
    loop = fl.trainer(module, SPARSE, "adam")  # one Loop for both runs: traced once
    unfused = loop.run(data, epochs=2)
    fused = loop.run(data, epochs=2, fuse=4)
    assert fused.history == unfused.history


def test_batched_module_with_dropout_trains_and_gets_the_step_key_for_the_batch():
    module = BatchedDropoutNet(jax.random.PRNGKey(0))
    model = fl.models.from_equinox(module, batched=True)
    loop = fl.trainer(model, SPARSE, "adam")  # one Loop for both runs: traced once
    fused = loop.run(DATA, epochs=2, fuse=4)
    unfused = loop.run(DATA, epochs=2)
    _leaves_equal(fused.step_state, unfused.step_state)
    assert np.isfinite(unfused.metrics["loss"])
    # One key for the whole batch: the step's key itself.
    rng = jax.random.PRNGKey(5)
    y, _ = model.forward(model.init(None, None), X[:4], train=True, rng=rng)
    expected = eqx.nn.inference_mode(module, False)(X[:4], key=rng)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
    # Dropout is on: a different step key draws a different mask.
    other, _ = model.forward(model.init(None, None), X[:4], train=True, rng=jax.random.PRNGKey(6))
    assert not np.array_equal(np.asarray(y), np.asarray(other))


def test_batched_default_key_module_is_evaluated_without_a_key():
    module = BatchedDropoutNet(jax.random.PRNGKey(0))
    model = fl.models.from_equinox(module, batched=True)
    state = fl.trainer(model, SPARSE, "adam").run(DATA)
    trained = fl.models.trained(model, state)
    np.testing.assert_allclose(np.asarray(fl.predict(model, state, X)), trained(X), rtol=1e-6)


def test_batched_module_requiring_a_key_trains_and_evaluates():
    module = BatchedRequiredKeyNet(jax.random.PRNGKey(0))
    model = fl.models.from_equinox(module, batched=True)
    state = fl.trainer(model, SPARSE, "adam").validate(model, DATA).run(DATA, epochs=2)
    assert np.isfinite(state.metrics["validation_loss"])
    trained = fl.models.trained(model, state)
    expected = trained(X, key=jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(fl.predict(model, state, X)), expected, rtol=1e-6)


def test_training_forward_without_a_key_for_a_required_key_is_refused_by_name():
    adapter = fl.models.from_equinox(KeywordOnlyKeyNet(jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match=r"requires `key`"):
        adapter.forward(adapter.init(None, None), X[:4], train=True, rng=None)


class Encoder(eqx.Module):
    """Dropout behind an `inference` flag that trains by default."""

    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __call__(self, x, *, key=None, inference=False):
        return self.drop(jax.nn.relu(self.dense(x)), key=key, inference=inference)


class Classifier(eqx.Module):
    encoder: Encoder
    head: eqx.nn.Linear

    def __call__(self, x, *, key=None):
        return self.head(self.encoder(x, key=key))


def test_a_trained_module_reused_inside_a_larger_model_trains_with_its_dropout():
    # `fl.models.trained` hands back a subclass that passes inference=True: inside a model
    # fine-tuned afterwards it kept the encoder's Dropout off while training, silently.
    encoder = Encoder(eqx.nn.Linear(FEATURES, 8, key=jax.random.PRNGKey(0)), eqx.nn.Dropout(0.9))
    pretrain = [(x, np.zeros((len(x), 8), np.float32)) for x, _ in DATA]
    pretrained = fl.models.trained(encoder, fl.trainer(encoder, "mse", "sgd").run(pretrain))
    head = eqx.nn.Linear(8, CLASSES, key=jax.random.PRNGKey(1))
    as_built = Classifier(Encoder(pretrained.dense, eqx.nn.Dropout(0.9)), head)
    reused = fl.trainer(Classifier(pretrained, head), SPARSE, "sgd").run(DATA)
    expected = fl.trainer(as_built, SPARSE, "sgd").run(DATA)
    assert reused.history == expected.history


class _NoiseUnder(eqx.Module):
    """Draws noise while training from a key parameter named other than `key`."""

    dense: eqx.nn.Linear

    def __init__(self):
        self.dense = eqx.nn.Linear(FEATURES, CLASSES, key=jax.random.PRNGKey(0))


class DefaultRngNet(_NoiseUnder):
    def __call__(self, x, rng=None):
        noise = 0.0 if rng is None else jax.random.normal(rng, x.shape)
        return self.dense(x + noise)


class DropoutKeyNet(_NoiseUnder):
    def __call__(self, x, dropout_key=None):
        keep = 1.0 if dropout_key is None else jax.random.bernoulli(dropout_key, 0.5, x.shape)
        return self.dense(x * keep)


class RequiredRngNet(_NoiseUnder):
    def __call__(self, x, *, rng):
        return self.dense(x + jax.random.normal(rng, x.shape))


@pytest.mark.parametrize("net, name", [(DefaultRngNet, "rng"), (DropoutKeyNet, "dropout_key")])
def test_a_key_parameter_of_another_name_is_warned_about_as_never_given(net, name):
    # Equinox modules get their key as `key` only: one named otherwise kept its default,
    # and the module trained without its noise, in silence.
    with pytest.warns(UserWarning, match=rf"parameter '{name}' reads as a PRNG key.*`key`"):
        fl.trainer(net(), SPARSE, "sgd")


def test_a_required_key_parameter_of_another_name_is_refused_naming_key():
    with pytest.raises(ValueError, match=r"RequiredRngNet.__call__'s parameter 'rng'.*to `key`"):
        fl.trainer(RequiredRngNet(), SPARSE, "sgd")


class _Permuted(eqx.Module):
    """A linear layer over its input's features in a fixed order: `perm` is an int array
    field, not trained."""

    weight: jax.Array
    perm: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight @ x[self.perm]


def _permuted(perm: list[int]) -> _Permuted:
    return _Permuted(jax.numpy.ones((3, 4)) * 0.1, jax.numpy.asarray(perm, jax.numpy.int32))


def test_a_module_with_other_untrained_fields_than_the_loops_is_refused():
    # The README's reuse (one trainer, a fresh module per fold) trained and predicted with
    # the trainer's own module's int fields, those of the module given dropped in silence.
    base, other = _permuted([0, 1, 2, 3]), _permuted([3, 2, 1, 0])
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    data = [(x, np.zeros(8, np.int32))]
    loop = fl.trainer(base, "sparse_categorical_cross_entropy", "sgd")
    with pytest.raises(ValueError, match=r"init_state: .*\(model\.perm: int or bool"):
        loop.run(data, other)
    with pytest.raises(ValueError, match=r"variables_or_state: .*model\.perm"):
        fl.predict(base, other, x)
    # The same fields: taken (a fresh module of the same layer, its weights anew).
    again = _permuted([0, 1, 2, 3])
    assert loop.run(data, again).status == "completed"
    np.testing.assert_allclose(fl.predict(other, other, x), jax.vmap(other)(x), rtol=1e-6)


class _Dropped(eqx.Module):
    """A layer with Dropout (its `inference` a flag each call sets) and an int field."""

    linear: eqx.nn.Linear
    drop: eqx.nn.Dropout
    order: np.ndarray

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        return self.drop(self.linear(x[self.order]), key=key)


def test_modules_differing_in_flags_or_int_widths_alone_are_taken():
    # The field check refused a trained module (inference mode) and the same ints held
    # as int64 and int32; neither reaches the programs otherwise.
    def build(order: Any) -> _Dropped:
        linear = eqx.nn.Linear(4, 3, key=jax.random.PRNGKey(0))
        return _Dropped(linear, eqx.nn.Dropout(0.5), order)

    base = build(np.arange(4))  # int64 on the host
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    loop = fl.trainer(base, "sparse_categorical_cross_entropy", "sgd")
    state = loop.run([(x, np.zeros(8, np.int32))])
    trained = fl.models.trained(base, state)
    np.testing.assert_array_equal(fl.predict(base, trained, x), fl.predict(base, state, x))
    assert loop.run([(x, np.zeros(8, np.int32))], trained).status == "completed"
    narrower = build(jax.numpy.arange(4, dtype=jax.numpy.int32))
    assert loop.run([(x, np.zeros(8, np.int32))], narrower).status == "completed"
    with pytest.raises(TypeError, match=r"Monte Carlo"):  # predict's keyword advice
        fl.predict(base, state, x, train=True)
