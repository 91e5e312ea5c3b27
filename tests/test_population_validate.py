"""Validation and early stopping on a validation metric, for a population."""

import numpy as np

import fuseloop as fl

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 4)).astype(np.float32)
Y = RNG.integers(0, 3, 64).astype(np.int32)
TRAIN = fl.data.arrays(X, Y, batch_size=16, seed=0)
VAL = fl.data.arrays(X[:32], Y[:32], batch_size=16, shuffle=False)
MODEL = fl.models.mlp([8, 3])
LOSS = "sparse_categorical_cross_entropy"


def test_population_validates_each_member_fused_equals_unfused():
    loop = (
        fl.trainer(MODEL, LOSS, "adam")
        .metric("accuracy")
        .validate(MODEL, VAL)
        .early_stop("validation_loss", patience=1)
    )
    unfused = loop.run(TRAIN, epochs=3, population=3)
    fused = loop.run(TRAIN, epochs=3, fuse=2, population=3)
    for epoch, metrics in unfused.history.items():
        for name, value in metrics.items():
            np.testing.assert_array_equal(fused.history[epoch][name], value)
    assert unfused.metrics["validation_loss"].shape == (3,)
    evaluator = fl.evaluator(MODEL, LOSS).metric("accuracy")
    for i in range(3):
        member = unfused.member(i)
        alone = evaluator.run(VAL, member.params)
        np.testing.assert_allclose(
            member.metrics["validation_loss"], alone.metrics["loss"], rtol=1e-6
        )
