"""What a metric may return, and labels the built-in class metrics cannot read: refused
with the fix, never averaged into a number that means something else."""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl

_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(40, 6)).astype(np.float32)
_Y = _RNG.integers(0, 3, 40).astype(np.int32)
_MULTI_HOT = (_X[:, :3] > 0).astype(np.float32)  # several labels per example, or none


def _counts(y_true, y_pred):
    return jnp.sum(jnp.argmax(y_pred, -1) == y_true), y_true.shape[0]


def _columns(y_true, y_pred):
    return {"first": y_pred[:, 0], "second": y_pred[:, 1]}


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize(("metric", "kind"), [(_counts, "tuple"), (_columns, "dict")])
def test_a_metric_returning_several_values_is_refused_with_or_without_jit(metric, kind, jit):
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    with pytest.raises(TypeError, match=f"metric 'm' returned a {kind}, not an array"):
        loop.metric(metric, name="m").run(fl.data.arrays(_X, _Y, batch_size=8), jit=jit)


def _per_class_hits(y_true, y_pred):  # one count per class, not per example
    return jnp.sum(jax.nn.one_hot(y_true, 3) * jax.nn.one_hot(jnp.argmax(y_pred, -1), 3), 0)


def _column(state: fl.State, name: str) -> list[float]:
    return [state.history[epoch][name] for epoch in sorted(state.history)]


def test_a_metric_of_another_leading_axis_than_the_batch_is_said_to_average_per_batch():
    """Each metric is compared with its reference metric in the same run (the warned case
    in one run, the silent ones in another), so the file compiles two programs, not one
    per metric."""
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    data = fl.data.arrays(_X, _Y, batch_size=8, shuffle=False)
    mean_hits = lambda t, p: jnp.mean(_per_class_hits(t, p))  # noqa: E731
    warned = loop.metric(_per_class_hits, name="hits").metric(mean_hits, name="per_batch")
    with pytest.warns(UserWarning, match=r"'hits' returned shape \(3,\) for a batch of 8") as said:
        hits = warned.run(data)
    assert said[0].filename == __file__  # the run's line, not jax's tracing frames
    assert _column(hits, "hits") == _column(hits, "per_batch")  # one value per batch, their mean
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Summed, the counts are exact: no warning. Per-element values flattened (a
        # multiple of the batch) average over the elements, as before.
        silent = (
            loop.metric(_per_class_hits, name="summed", accumulate="running_sum")
            .metric(lambda t, p: jnp.sum(_per_class_hits(t, p)), "total", "running_sum")
            .metric(lambda t, p: jnp.mean(_per_class_hits(t, p))[None], name="one")
            .metric(mean_hits, name="per_batch")
            .metric(lambda t, p: jnp.repeat(t == jnp.argmax(p, -1), 2), name="tokens")
            .metric(lambda t, p: t == jnp.argmax(p, -1), name="plain")
        )
        state = silent.run(data)
    assert _column(state, "summed") == _column(state, "total")
    assert _column(state, "one") == _column(state, "per_batch")  # (1,): a scalar
    assert _column(state, "tokens") == _column(state, "plain")


@functools.cache
def _one_output() -> tuple[Any, Any, np.ndarray]:
    """A one-output MLP, its variables and its outputs on the first 20 examples (made in
    jit: the references below compare with a tolerance)."""
    model = fl.models.mlp([1])
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), _X[:1])
    return model, variables, np.asarray(jax.jit(model.apply)(variables, _X[:20]))


def test_a_per_batch_scalar_in_the_targets_does_not_change_how_the_loss_is_weighed():
    # A callable loss is weighed by the examples of the batch: a scalar leaf of y (its
    # key sorting first) is not the batch.
    def loss(y, p):
        return jnp.mean((p - y["target"]) ** 2) * sum(v for k, v in y.items() if k != "target")

    ys = _RNG.normal(size=(20, 1)).astype(np.float32)
    model, variables, out = _one_output()
    evaluator = fl.evaluator(model, loss)
    sizes = [(0, 8), (8, 16), (16, 20)]  # a short last batch
    for key in ("alpha", "z_alpha"):
        batches = [(_X[a:b], {key: np.float32(1.0), "target": ys[a:b]}) for a, b in sizes]
        got = evaluator.run(batches, variables).metrics["loss"]
        expected = np.mean((out - ys) ** 2)
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_targets_without_an_example_axis_weigh_the_batch_by_its_inputs_rows():
    """A self-supervised loss beside a dummy label (`(x, 0)`) or a per-batch temperature
    (`(x, {"tau": 0.5})`) weighed a short last batch as one example: the loss read the
    mean over batches, where `(x, None)` and Keras weigh by x's rows."""
    model, variables, out = _one_output()
    expected = np.mean(out[:, 0] ** 2)  # over the 20 examples, not over the 3 batches
    sizes = [(0, 8), (8, 16), (16, 20)]

    def loss(y_true, y_pred):
        return jnp.mean(y_pred**2)

    evaluator = fl.evaluator(model, loss)
    for y in (None, 0, np.float32(0.0), {"tau": np.float32(0.5)}):
        batches = [(_X[a:b], y) for a, b in sizes]
        got = evaluator.run(batches, variables).metrics["loss"]
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=repr(y))


def test_a_per_example_metric_is_not_warned_about_where_the_output_has_other_rows():
    """The batch's examples were read from the model's output: a SimCLR output of both
    views (2B rows) or a dict leading with class centres made a per-anchor metric of B
    values look like something other than one value per example."""

    def two_views(p, x):
        z = x @ p["w"]
        return jnp.concatenate([z, z + 1.0])  # (2B, 2)

    def centres_first(p, x):
        return {"centers": p["c"], "z": x @ p["w"]}

    def anchors(y_true, y_pred):
        z = y_pred["z"] if isinstance(y_pred, dict) else y_pred[: y_pred.shape[0] // 2]
        return (z[:, 0] > 0).astype(jnp.float32)  # one value per anchor (example)

    params = {"w": np.ones((6, 2), np.float32), "c": np.ones((5, 2), np.float32)}
    batches = [(_X[a:b], np.zeros(b - a, np.int32)) for a, b in [(0, 16), (16, 32), (32, 38)]]
    expected = float(np.mean((_X[:38] @ params["w"])[:, 0] > 0))
    for apply in (two_views, centres_first):
        model = fl.models.from_functions(lambda rng, x: params, apply)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            state = fl.evaluator(model).metric(anchors, name="hit").run(batches, params)
        np.testing.assert_allclose(state.metrics["hit"], expected, rtol=1e-6)


def test_class_metrics_refuse_multi_hot_labels_they_would_read_as_one_class():
    model = fl.models.mlp([3])
    state = fl.trainer(model, "binary_cross_entropy", "sgd").run(
        fl.data.arrays(_X, _MULTI_HOT, batch_size=8)
    )
    data = fl.data.arrays(_X, _MULTI_HOT, batch_size=8, shuffle=False)
    evaluator = fl.evaluator(model).metric("accuracy").metric("recall")
    with pytest.raises(ValueError, match=r"'accuracy', 'recall' would compare each row's argm"):
        evaluator.run(data, state)
    # Under binary cross-entropy the same metrics are element-wise, as Keras's are.
    measured = fl.evaluator(model, "binary_cross_entropy").metric("accuracy").run(data, state)
    predicted = np.asarray(fl.predict(model, state, _X)) > 0
    expected = (predicted == (_MULTI_HOT > 0.5)).mean()
    assert measured.metrics["accuracy"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_multi_hot_labels_past_the_first_batch_are_refused_whatever_the_shuffle(seed):
    """Rows with two labels among rows with one: the check read the first batch only, so
    whether a run was refused or scored each row's argmax depended on the shuffle seed.
    An in-memory dataset's labels are read whole."""
    one_hot = np.eye(3, dtype=np.float32)[_Y]
    labels = one_hot.copy()
    labels[-1] = 1.0  # one row of 40 holds three labels
    own_loss = lambda y, p: jnp.mean((p - y) ** 2)  # noqa: E731
    loop = fl.trainer(fl.models.mlp([3]), own_loss, "sgd").metric("accuracy")
    with pytest.raises(ValueError, match=r"a row of y sums to 3"):
        loop.run(fl.data.arrays(_X, labels, batch_size=8, seed=seed))
    batches = [(_X[i : i + 8], labels[i : i + 8]) for i in range(0, 40, 8)]
    with pytest.raises(ValueError, match=r"a row of y sums to 3"):
        loop.run(batches[seed:] + batches[:seed])  # a list of batches: read whole too


def _masked_loss(y, p):  # leaves labels below 0 (padding) out, as a sequence model's does
    real = y >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(p, jnp.where(real, y, 0))
    return jnp.sum(losses * real) / jnp.maximum(jnp.sum(real), 1)


@pytest.mark.parametrize("fuse", [False, 2])
def test_class_indices_outside_the_outputs_classes_are_refused_not_scored_wrong(fuse):
    """Padding labels (-100, PyTorch's ignore index) under a masking loss of one's own:
    'accuracy' scored each one as a wrong prediction, silently."""
    padded = _Y.copy()
    padded[-3:] = -100
    loop = fl.trainer(fl.models.mlp([3]), _masked_loss, "sgd").metric("accuracy")
    refused = r"y holds -100, but 'accuracy' read y as class indices of the model's 3 outputs"
    with pytest.raises(ValueError, match=refused):
        loop.run(fl.data.arrays(_X, padded, batch_size=8), fuse=fuse)
    batches = [(_X[i : i + 8], padded[i : i + 8]) for i in range(0, 40, 8)]
    with pytest.raises(ValueError, match=r"iteration 4: y holds -100"):
        loop.run(iter(batches), fuse=fuse)  # an iterator's, as its batch arrives
    state = loop.run(fl.data.arrays(_X, _Y, batch_size=8), fuse=fuse)
    evaluator = fl.evaluator(fl.models.mlp([3])).metric("recall")  # no loss to refuse them
    with pytest.raises(ValueError, match=r"y holds -100, but 'recall'"):
        evaluator.run(batches, state)


def _one_hot_batches(bad_batch: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Five batches of 8 one-hot rows; in `bad_batch`, one row holds two labels."""
    labels = np.eye(3, dtype=np.float32)[_Y]
    if bad_batch is not None:
        labels[8 * bad_batch + 5] = [1.0, 0.0, 1.0]
    return [(_X[i : i + 8], labels[i : i + 8]) for i in range(0, 40, 8)]


@pytest.mark.parametrize("fuse", [False, 2])
def test_class_metrics_hold_each_batch_of_an_iterator_to_one_class_per_example(fuse):
    """An iterator's labels cannot be read before the run: each batch is held to the rule
    as it arrives (fused: as its chunk is stacked), and the bad one is named."""
    own_loss = lambda y, p: jnp.mean((p - y) ** 2)  # noqa: E731
    loop = fl.trainer(fl.models.mlp([3]), own_loss, "sgd").metric("accuracy")
    with pytest.raises(ValueError, match=r"epoch 0, iteration 3: .* a row of y sums to 2"):
        loop.run(iter(_one_hot_batches(bad_batch=3)), fuse=fuse)
    with pytest.raises(ValueError, match=r"iteration 3: .* a row of y sums to 2"):
        loop.run(lambda: iter(_one_hot_batches(bad_batch=3)), fuse=fuse)  # a callable's too
    one_output = fl.trainer(fl.models.mlp([1]), "mean_squared_error", "sgd").metric("recall")
    targets = [(x, (y.argmax(-1) > 0).astype(np.float32)[:, None]) for x, y in _one_hot_batches()]
    targets[4] = (targets[4][0], targets[4][1] * 2)  # a class index of 2 among 0/1 targets
    with pytest.raises(ValueError, match=r"iteration 4: .*'recall' read as a binary logit"):
        one_output.run(iter(targets), fuse=fuse)


def test_a_second_run_of_a_loop_holds_its_own_data_to_the_class_metrics_rule():
    """The rule is found once per Loop, but each run's data is held to it: a later run
    over multi-hot labels is refused as a first one would be."""
    loop = fl.trainer(fl.models.mlp([3]), "categorical_cross_entropy", "sgd").metric("accuracy")
    loop.run(_one_hot_batches())
    with pytest.raises(ValueError, match=r"the run's labels .* a row of y sums to 2"):
        loop.run(_one_hot_batches(bad_batch=4))
    good = fl.data.arrays(_X, np.eye(3, dtype=np.float32)[_Y], batch_size=8)
    loop.run(good)
    with pytest.raises(ValueError, match=r"a row of y sums to 2"):
        loop.run(fl.data.arrays(_X, np.concatenate([y for _, y in _one_hot_batches(1)]), 8))
    loop.run(good)  # (the dataset found to hold keeps its verdict)
    # An all-zero row is the one-hot of padding, not multi-hot: it was told to pass
    # binary_cross_entropy, which would train the padded rows as "no class".
    padded = np.eye(3, dtype=np.float32)[_Y]
    padded[5] = 0.0
    with pytest.raises(ValueError, match=r"all zeros \(a padded position\?\).*running_sum"):
        loop.run(fl.data.arrays(_X, padded, batch_size=8))
    # Multi-hot labels with rare positives hold all-zero rows too: a row of two labels
    # after one of none is told as multi-hot, not as padding.
    padded[6] = [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"a row of y sums to 2 \(multi-hot"):
        loop.run(fl.data.arrays(_X, padded, batch_size=8))
    from fuseloop._class_labels import ClassLabels  # a row summing to 0 is not all zeros

    with pytest.raises(ValueError, match=r"sums to 0 \(multi-hot"):
        ClassLabels(("accuracy",), (2, 3), per_row=True).check(
            np.array([[1, 0, 0], [1, -1, 0]]), "b"
        )
    # The rule depends on the labels' shape, so a run over integer labels has none.
    either = lambda y, p: jnp.mean(  # noqa: E731
        optax.softmax_cross_entropy(p, y)
        if y.ndim == 2
        else optax.softmax_cross_entropy_with_integer_labels(p, y)
    )
    both = fl.trainer(fl.models.mlp([3]), either, "sgd").metric("accuracy")
    one_hot = both.run(good)
    integers = both.run(fl.data.arrays(_X, _Y, batch_size=8))
    assert integers.metrics == one_hot.metrics  # the same loss and accuracy, read as meant


def test_multi_hot_validation_labels_are_refused_before_the_first_epoch_trains():
    """Host validation refused them after the first epoch; a whole-run dispatch's device
    validation scored them as argmax. Both refuse before anything trains, as do bfloat16
    labels (numpy does not call bfloat16 a number)."""
    one_hot = np.concatenate([y for _, y in _one_hot_batches(bad_batch=2)])
    seen = []
    for dtype in (np.float32, jnp.bfloat16):
        val = fl.data.arrays(_X, one_hot.astype(dtype), batch_size=8, device=True)
        loop = fl.trainer(fl.models.mlp([3]), "categorical_cross_entropy", "sgd")
        loop = loop.metric("accuracy").validate(fl.models.mlp([3]), val)
        loop = loop.handle_event("epoch_started", lambda state: seen.append(state.epoch))
        for fuse in (False, "run"):
            train = fl.data.arrays(_X, np.eye(3, dtype=np.float32)[_Y], 8, device=True)
            with pytest.raises(ValueError, match=r"a row of y sums to 2"):
                loop.run(train, epochs=2, fuse=fuse)
    assert seen == []


def test_class_metrics_of_a_one_output_model_refuse_targets_outside_0_and_1():
    # One output per example is read as a binary logit against 0/1 targets: class indices
    # 0..2 or regression targets would be thresholded at 0.5 into a meaningless score.
    model = fl.models.mlp([1])
    state = fl.trainer(model, "mean_squared_error", "sgd").run(fl.data.arrays(_X, _Y, 8))
    for metric in ("accuracy", "precision"):
        evaluator = fl.evaluator(model).metric(metric)
        with pytest.raises(ValueError, match=rf"'{metric}' read as a binary logit.*holds 2"):
            evaluator.run(fl.data.arrays(_X, _Y, batch_size=8, shuffle=False), state)
    trainer = fl.trainer(model, "mean_squared_error", "sgd").metric("accuracy")
    with pytest.raises(ValueError, match=r"regression, track .mean_absolute_error. or"):
        trainer.run(fl.data.arrays(_X, _X[:, 0] * 3, batch_size=8))
    accuracy = fl.evaluator(model).metric("accuracy")  # one Loop for both target kinds
    binary = (_Y > 0).astype(np.float32)  # 0/1 targets are what the metric reads
    measured = accuracy.run(fl.data.arrays(_X, binary, 8), state)
    signs = np.where(_Y > 0, 1.0, -1.0).astype(np.float32)  # -1/+1 labels read as meant
    accuracy.run(fl.data.arrays(_X, signs, 8), state)
    expected = ((np.asarray(fl.predict(model, state, _X))[:, 0] > 0) == (binary > 0.5)).mean()
    assert measured.metrics["accuracy"] == pytest.approx(expected, abs=1e-6)


def test_one_hot_and_soft_labels_still_read_as_one_class():
    model = fl.models.mlp([3])
    soft = np.eye(3, dtype=np.float32)[_Y] * 0.9 + 0.1 / 3  # label smoothing: rows sum to 1
    loop = fl.trainer(model, "categorical_cross_entropy", "sgd").metric("accuracy")
    state = loop.run(fl.data.arrays(_X, soft, batch_size=8, shuffle=False))
    assert 0.0 <= state.metrics["accuracy"] <= 1.0


def test_the_short_batch_warning_says_how_a_per_batch_scalar_weighs_it():
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    data = fl.data.arrays(_X[:36], _Y[:36], batch_size=8, drop_remainder=False)
    with pytest.warns(UserWarning, match="one scalar per batch counts it as one batch"):
        loop.run(data)


def _custom_step(batch, state):
    x, _ = batch
    return {**state, "y_pred": x[:, :3], "accuracy": jnp.float32(0.125)}


def test_a_custom_states_own_entry_under_a_built_in_name_is_refused_not_shadowed():
    state = {"y_pred": jnp.zeros((8, 3)), "accuracy": jnp.float32(0.0)}
    with pytest.raises(ValueError, match="also holds its own 'accuracy': which one to track"):
        fl.loop(_custom_step).metric("accuracy").run(fl.data.arrays(_X, _Y, 8), state)


def test_a_metric_named_after_the_batchs_labels_is_not_read_from_them():
    state = {"y_pred": jnp.zeros((8, 3)), "accuracy": jnp.float32(0.0)}
    with pytest.raises(ValueError, match="reads 'y_true', which the step does not produce"):
        fl.loop(_custom_step).metric("y_true").run(fl.data.arrays(_X, _Y, 8), state)


def test_a_named_tuple_step_states_field_is_not_read_and_the_refusal_says_why():
    class Counts(NamedTuple):
        n: Any
        loss: Any

    def step(batch, state):
        return Counts(state.n + 1, state.loss + batch[0].sum())

    start = Counts(np.int32(0), np.float32(0.0))
    with pytest.raises(ValueError, match=r"type is Counts: a metric reads a dict's keys by na"):
        fl.loop(step).metric("loss").run(fl.data.arrays(_X, _Y, 8), start)


def test_a_step_returning_state_and_metrics_or_nothing_is_told_what_fl_loop_expects():
    def pair(batch, state):
        return {"w": state["w"] + 1.0}, {"loss": jnp.float32(0.0)}

    def mutating(batch, state):
        state["w"] = state["w"] + 1.0  # in place, as a NumPy habit writes

    data = fl.data.arrays(_X, _Y, 8)
    with pytest.raises(TypeError, match=r"returned a pair \(step state, something else\)"):
        fl.loop(pair).run(data, {"w": jnp.float32(0.0)})
    with pytest.raises(TypeError, match="step_fn returned None"):
        fl.loop(mutating).run(data, {"w": jnp.float32(0.0)})
