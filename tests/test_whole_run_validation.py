"""Whole-run fusion with validation data whose last batch is short (`drop_remainder=False`):
the evaluator's device loop runs it as a step of its own shape inside the dispatch, so the
validation metrics (per-example sums and counts) are bitwise the unfused run's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from test_whole_run import _assert_same_run, _data, _xy


@functools.cache
def _loop(n: int, per_example: bool) -> fl.Loop:
    """One Loop per configuration, shared by this file's tests (a Loop is reusable; sharing
    it skips re-tracing its programs)."""
    vx, vy = _xy(seed=5, n=n)
    model = fl.models.mlp([8, 3])
    val = fl.data.arrays(vx, vy, batch_size=16, device=True, drop_remainder=False)
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.05))
    loop = loop.metric("accuracy")
    if per_example:
        loop = loop.metric("precision")
    return loop.validate(model, val).early_stop("validation_loss", patience=2, restore_best=True)


@pytest.mark.parametrize(("n", "per_example"), [(40, False), (41, True), (10, False)])
def test_short_last_validation_batch_runs_on_the_device(n, per_example):
    loop = _loop(n, per_example)
    plain = loop.run(_data(), epochs=12, fuse=False)
    fused = loop.run(_data(), epochs=12, fuse="run")
    _assert_same_run(fused, plain)
    assert "validation_loss" in fused.history[0]
    assert fused.stats["dispatches"] == 1
    assert fused.stats["dispatch_splits"] == {}
    again = loop.run(_data(), epochs=12, fuse="run")
    assert again.stats["compiles"] == 0


def test_the_device_validation_equals_a_plain_evaluator_run():
    # The Loop of test_short_last_validation_batch_runs_on_the_device[40-False] (40
    # examples: a short last batch of 8). 3 epochs: its early stop restores no best epoch.
    loop = _loop(40, False)
    fused = loop.run(_data(), epochs=3, fuse="run")
    vx, vy = _xy(seed=5, n=40)
    scores = fl.evaluator(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy").metric(
        "accuracy"
    )
    val = fl.data.arrays(vx, vy, batch_size=16, device=True, drop_remainder=False)
    measured = scores.run(val, fused.params).metrics
    assert fused.metrics["validation_loss"] == measured["loss"]
    assert fused.metrics["validation_accuracy"] == measured["accuracy"]
    correct = np.argmax(np.asarray(fl.predict(fl.models.mlp([8, 3]), fused.params, vx)), -1)
    assert np.isclose(fused.metrics["validation_accuracy"], np.mean(correct == vy))


def test_a_custom_loops_device_validation_is_bitwise_its_host_validation():
    # XLA reduced the metric's per-batch sum in another order inside the dispatch than in
    # the evaluator's own program; the sums are now added in one fixed order.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(270, 8)).astype(np.float32)
    y = (x @ np.arange(8, dtype=np.float32)[:, None] / 8).astype(np.float32)
    opt = optax.sgd(0.05)
    model = fl.models.from_functions(
        lambda r, x: {"w": jnp.zeros((8, 1)), "b": jnp.zeros((1,))},
        lambda p, x: x @ p["w"] + p["b"],
    )

    def init_fn(batch, _):
        p = {"w": jnp.full((8, 1), 0.05), "b": jnp.zeros((1,))}
        return {"params": p, "opt_state": opt.init(p), "y_pred": jnp.zeros((32, 1))}

    def step_fn(batch, s):
        xb, yb = batch

        def loss(p):
            out = model.apply(p, xb)
            return jnp.mean((out - yb) ** 2), out

        (_, out), g = jax.value_and_grad(loss, has_aux=True)(s["params"])
        u, o = opt.update(g, s["opt_state"], s["params"])
        return {"params": optax.apply_updates(s["params"], u), "opt_state": o, "y_pred": out}

    def history(fuse):
        val = fl.data.arrays(x[200:], y[200:], batch_size=32, shuffle=False, device=True)
        loop = fl.loop(step_fn, init_fn).metric("mean_absolute_error").validate(model, val)
        train = fl.data.arrays(x[:200], y[:200], batch_size=32, seed=2, device=True)
        return loop.run(train, 0, epochs=3, fuse=fuse).history

    plain = history(False)
    assert history("run") == plain and history(4) == plain


@pytest.mark.parametrize("population", [None, 2])
def test_a_bad_validation_label_is_refused_on_the_device_as_on_the_host(population):
    """The evaluator never runs on the host in a whole run, so its start-of-run checks
    run before the first dispatch: an out-of-range validation label was a silent NaN."""
    vx, vy = _xy(seed=5, n=40)
    vy = vy.copy()
    vy[37] = 3  # three classes
    model = fl.models.mlp([8, 3])
    val = fl.data.arrays(vx, vy, batch_size=16, device=True, drop_remainder=False)
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.05))
    loop = loop.validate(model, val).early_stop("validation_loss", patience=2)
    members = {} if population is None else {"population": population}
    for fuse in (False, "run"):
        with pytest.raises(ValueError, match="y holds the label 3, out of range .* 4 units") as got:
            loop.run(_data(), epochs=3, fuse=fuse, **members)
        # Named as the validation data's, not the training data's (its message says "data:").
        assert "validate()'s data" in "".join(getattr(got.value, "__notes__", []))


@pytest.mark.parametrize("population", [None, 2])
def test_an_early_stop_on_a_nan_validation_loss_warns_on_the_device_as_on_the_host(population):
    """A NaN in the validation data makes validation_loss NaN while the training loss is
    finite; the early stop halts at once, which was silent."""
    vx, vy = _xy(seed=5, n=40)
    vx = vx.copy()
    vx[3, 1] = np.nan
    model = fl.models.mlp([8, 3])
    val = fl.data.arrays(vx, vy, batch_size=16, device=True, drop_remainder=False)
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.05))
    loop = loop.validate(model, val).early_stop("validation_loss", patience=2)
    members = {} if population is None else {"population": population}
    said = " for members \\[0, 1\\]" if population else ""
    for fuse in (False, "run"):
        with pytest.warns(RuntimeWarning, match=f"validation_loss is nan at epoch 0{said}, not"):
            state = loop.run(_data(), epochs=3, fuse=fuse, **members)
        assert state.status == "halted" and list(state.history) == [0]
