"""Validation and early stopping on a validation metric, for a population."""

import jax
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


def test_a_stopped_members_validation_reads_nan_as_its_training_metrics_do():
    scores = {0: [3.0, 2.0, 1.0, 0.5, 0.2], 1: [1.0, 2.0, 3.0, 4.0, 5.0]}  # member 1 stops

    def script(state):
        values = np.array([scores[0][state.epoch], scores[1][state.epoch]])
        return "continue", state.replace(metrics={**state.metrics, "score": values})

    loop = (
        fl.trainer(MODEL, LOSS, "adam")
        .validate(MODEL, VAL)
        .handle_event("epoch_completed", script)
        .early_stop("score", patience=1)
    )
    for fuse in (False, "run"):
        state = loop.run(
            fl.data.arrays(X, Y, 16, seed=0, device=True),
            epochs=5,
            fuse=fuse,
            population={"learning_rate": [0.01, 0.02]},
        )
        # Member 1 stops after epoch 1: from epoch 2 on its values are NaN, both kinds.
        for epoch in (2, 3, 4):
            assert np.isnan(state.history[epoch]["loss"][1])
            assert np.isnan(state.history[epoch]["validation_loss"][1])
            assert not np.isnan(state.history[epoch]["validation_loss"][0])
        assert not np.isnan(state.history[1]["validation_loss"][1])


def test_population_values_a_member_could_not_take_are_refused():
    import optax
    import pytest

    placeholder = optax.inject_hyperparams(optax.sgd)(learning_rate=1)  # kept as int32
    loop = fl.trainer(MODEL, LOSS, placeholder)
    with pytest.raises(ValueError, match=r"keeps learning_rate as int32.*0.1 would be cut"):
        loop.run(TRAIN, population={"learning_rate": [0.1, 0.5]})
    with pytest.raises(ValueError, match=r"population\['seed'\]: 1099511627776 is outside 32 b"):
        fl.trainer(MODEL, LOSS, "adam").run(TRAIN, population={"seed": [2**40, 2]})
    with pytest.raises(ValueError, match=r"member seeds .* 4294967296 is outside 32 bits"):
        fl.trainer(MODEL, LOSS, "adam", seed=2**32 - 1).run(TRAIN, population=2)
    with pytest.raises(ValueError, match=r"member seeds .* 10000000000 is outside 32 bits"):
        fl.trainer(MODEL, LOSS, "adam", seed=1).run(TRAIN, population=10**10)  # at once
    # A seed past int32 draws the key a solo run of that seed draws (it was refused, and the
    # advice, seed % 2**31, would have made the member another solo run's).
    high = 2**31 + 3
    members = fl.trainer(MODEL, LOSS, "sgd").run(TRAIN, population={"seed": [3, high]})
    solo = fl.trainer(MODEL, LOSS, "sgd", seed=high).run(TRAIN)
    pairs = zip(
        jax.tree.leaves(members.member(1).params), jax.tree.leaves(solo.params), strict=True
    )
    for a, b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    for rates, named in (
        ([1e-3, float("nan")], "must be a finite number"),
        ([1e-3, -1.0], "negative"),
    ):
        with pytest.raises(ValueError, match=rf"population\['learning_rate'\]: .*{named}"):
            fl.trainer(MODEL, LOSS, "adam").run(TRAIN, population={"learning_rate": rates})
