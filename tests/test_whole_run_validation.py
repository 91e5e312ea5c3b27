"""Whole-run fusion with validation data whose last batch is short (`drop_remainder=False`):
the evaluator's device loop runs it as a step of its own shape inside the dispatch, so the
validation metrics (per-example sums and counts) are bitwise the unfused run's.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest

import fuseloop as fl
from test_whole_run import _assert_same_run, _data, _xy


def _loop(n: int, per_example: bool) -> fl.Loop:
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
    plain = _loop(n, per_example).run(_data(), epochs=12, fuse=False)
    loop = _loop(n, per_example)
    fused = loop.run(_data(), epochs=12, fuse="run")
    _assert_same_run(fused, plain)
    assert "validation_loss" in fused.history[0]
    assert fused.stats["dispatches"] == 1
    assert fused.stats["dispatch_splits"] == {}
    again = loop.run(_data(), epochs=12, fuse="run")
    assert again.stats["compiles"] == 0


def test_the_device_validation_equals_a_plain_evaluator_run():
    loop = _loop(41, False)
    fused = loop.run(_data(), epochs=3, fuse="run")
    vx, vy = _xy(seed=5, n=41)
    scores = fl.evaluator(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy").metric(
        "accuracy"
    )
    val = fl.data.arrays(vx, vy, batch_size=16, device=True, drop_remainder=False)
    measured = scores.run(val, fused.params).metrics
    assert fused.metrics["validation_loss"] == measured["loss"]
    assert fused.metrics["validation_accuracy"] == measured["accuracy"]
    correct = np.argmax(np.asarray(fl.predict(fl.models.mlp([8, 3]), fused.params, vx)), -1)
    assert np.isclose(fused.metrics["validation_accuracy"], np.mean(correct == vy))
