"""`state.metrics["learning_rate"]`: the rate of the epoch's last step, when the optimizer
exposes it; reduce_lr_on_plateau refuses a schedule at attach time."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import make_batches
from fuseloop._loop import Loop
from fuseloop._step import default_metrics

DATA = make_batches(6)
SPARSE = "sparse_categorical_cross_entropy"
SCHEDULE = optax.linear_schedule(1.0, 0.0, 100)


def trainer(optimizer):
    """`fl.trainer` with its default metrics ("loss", and "learning_rate" when exposed)."""
    loop = fl.trainer(fl.models.mlp([4, 3]), SPARSE, optimizer)
    return Loop(loop.program, metrics=default_metrics(loop.program))


@pytest.mark.parametrize(
    "optimizer, rates",
    [
        ("adam", [1e-3, 1e-3]),
        (optax.inject_hyperparams(optax.sgd)(learning_rate=0.25), [0.25, 0.25]),
        (optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE), [SCHEDULE(5), SCHEDULE(11)]),
        (optax.adam(SCHEDULE), [SCHEDULE(5), SCHEDULE(11)]),
        (optax.chain(optax.clip(1.0), optax.sgd(SCHEDULE)), [SCHEDULE(5), SCHEDULE(11)]),
    ],
)
@pytest.mark.parametrize("fuse", [False, 4])
def test_learning_rate_in_metrics_and_history(optimizer, rates, fuse):
    state = trainer(optimizer).run(DATA, epochs=2, fuse=fuse)
    for epoch, rate in enumerate(rates):
        assert state.history[epoch]["learning_rate"] == pytest.approx(float(rate), rel=1e-6)
    assert state.metrics["learning_rate"] == state.history[1]["learning_rate"]


def test_a_fixed_rate_is_not_reported():
    state = trainer(optax.adam(1e-3)).run(DATA)
    assert "learning_rate" not in state.metrics


def test_plateau_reduction_shows_in_the_next_epoch():
    loop = trainer("sgd").handle_event(
        "epoch_completed", lambda s: ("continue", s.replace(metrics={**s.metrics, "flat": 1.0}))
    )
    state = loop.reduce_lr_on_plateau("flat", factor=0.5, patience=0).run(DATA, epochs=3)
    rates = [state.history[e]["learning_rate"] for e in range(3)]
    # epoch 0 sets the best; epoch 1 plateaus and halves the rate for epoch 2
    np.testing.assert_allclose(rates, [1e-2, 1e-2, 5e-3], rtol=1e-6)


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE),
        optax.adam(SCHEDULE),
    ],
)
def test_plateau_on_a_schedule_is_refused_at_attach_time(optimizer):
    with pytest.raises(ValueError, match="schedule"):
        fl.trainer(fl.models.mlp([4, 3]), SPARSE, optimizer).reduce_lr_on_plateau("loss")


def test_several_injected_rates_are_not_reported_as_one():
    rates = {"slow": 1e-4, "fast": 1e-2}
    tx = optax.multi_transform(
        {k: optax.inject_hyperparams(optax.adam)(learning_rate=v) for k, v in rates.items()},
        lambda params: jax.tree.map(lambda leaf: "slow" if leaf.ndim == 1 else "fast", params),
    )
    assert "learning_rate" not in trainer(tx).run(DATA).metrics


def test_an_injected_rate_beside_a_scheduled_one_is_not_reported_as_the_rate():
    # Discriminative rates: the head's injected, the backbone's a schedule (its own state).
    tx = optax.multi_transform(
        {
            "head": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
            "body": optax.adam(SCHEDULE),
        },
        lambda params: jax.tree.map(lambda leaf: "head" if leaf.ndim == 1 else "body", params),
    )
    assert "learning_rate" not in trainer(tx).run(DATA).metrics


class _OwnInjectState(NamedTuple):
    hyperparams: dict[str, Any]


def _own_injected_sgd(rate: float) -> optax.GradientTransformation:
    def init(params: Any) -> _OwnInjectState:
        return _OwnInjectState({"learning_rate": jnp.asarray(rate)})

    def update(updates: Any, state: _OwnInjectState, params: Any = None) -> Any:
        step = state.hyperparams["learning_rate"]
        return jax.tree.map(lambda g: -step * g, updates), state

    return optax.GradientTransformation(init, update)


def test_an_injected_rate_beside_a_fixed_one_is_neither_reported_nor_reduced():
    # The fixed group left nothing in the state to count: the injected rate was reported
    # as the run's, and reduce_lr_on_plateau lowered that group's alone.
    labels = lambda params: jax.tree.map(lambda leaf: "a" if leaf.ndim == 1 else "b", params)  # noqa: E731
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    beside_fixed = [
        optax.multi_transform({"a": injected, "b": optax.adam(1e-1)}, labels),
        # A state of the user's own holding hyperparams["learning_rate"]: neither read nor
        # lowered by fuseloop (not optax's inject state), so a rate it fixes.
        optax.multi_transform({"a": injected, "b": _own_injected_sgd(0.5)}, labels),
        optax.partition({"a": injected, "b": optax.sgd(0.5)}, labels),
        optax.chain(
            optax.masked(injected, lambda p: jax.tree.map(lambda v: v.ndim == 1, p)),
            optax.masked(optax.adam(1e-1), lambda p: jax.tree.map(lambda v: v.ndim != 1, p)),
        ),
    ]
    for tx in beside_fixed:
        assert "learning_rate" not in trainer(tx).run(DATA).metrics
        with pytest.raises(ValueError, match="part of the params descend at a rate fixed"):
            trainer(tx).reduce_lr_on_plateau("loss")
    # A frozen part has no rate, and parts inside an injected rate descend at it: the
    # injected rate is the run's.
    zero_grads = optax.GradientTransformation(
        lambda params: (), lambda updates, state, params=None: (optax.tree.zeros_like(updates), ())
    )
    one_rate = [
        optax.multi_transform({"a": injected, "b": optax.set_to_zero()}, labels),
        optax.multi_transform({"a": injected, "b": optax.chain(optax.set_to_zero())}, labels),
        optax.multi_transform({"a": injected, "b": zero_grads}, labels),
        optax.inject_hyperparams(
            lambda learning_rate: optax.multi_transform(
                {"a": optax.adam(learning_rate), "b": optax.sgd(learning_rate)}, labels
            )
        )(learning_rate=1e-3),
    ]
    for tx in one_rate:
        assert trainer(tx).run(DATA).metrics["learning_rate"] == pytest.approx(1e-3)
        trainer(tx).reduce_lr_on_plateau("loss")


@pytest.mark.parametrize("fuse", [False, 4])
def test_optax_reduce_on_plateau_scales_the_reported_rate(fuse):
    """optax's own plateau transform multiplies the step by its scale: the reported rate is
    the one the step applies, as Keras reports a rate its ReduceLROnPlateau lowered."""
    plateau = optax.contrib.reduce_on_plateau(patience=0, factor=0.5, accumulation_size=1)
    tx = optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), plateau)
    state = trainer(tx).run(DATA, epochs=2, fuse=fuse)
    scale = float(state.step_state["opt_state"][1].scale)
    assert scale < 1.0  # it did reduce
    assert state.metrics["learning_rate"] == pytest.approx(0.1 * scale, rel=1e-6)
