"""An iteration handler that halts an epoch at its last step, in a whole-run dispatch with
validation monitors: the unfused loop never completes that epoch, so no monitor may judge
it on the device (a rate cut, a kept best, members stopped)."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import assert_tree_equal

_RNG = np.random.default_rng(0)
_X, _VX = (_RNG.normal(size=(n, 8)).astype(np.float32) for n in (48, 16))
_Y, _VY = (_RNG.integers(0, 3, n).astype(np.int32) for n in (48, 16))


def _data() -> fl.data.ArraySource:
    return fl.data.arrays(_X, _Y, batch_size=8, device=True)


def _validation() -> fl.data.ArraySource:
    return fl.data.arrays(_VX, _VY, batch_size=8, shuffle=False, device=True)


def _halting(status: str, epoch: int):
    def handler(state: fl.State) -> str | None:
        return status if (state.epoch, state.iteration) == (epoch, 5) else None  # last step

    return handler


@pytest.mark.parametrize("status", ["halt_epoch", "halt_loop"])
def test_a_plateau_on_validation_does_not_judge_an_epoch_an_iteration_handler_halted(status):
    model = fl.models.mlp([8, 3])
    loop = (
        fl.trainer(
            model, "sparse_categorical_cross_entropy", optax.inject_hyperparams(optax.sgd)(0.3)
        )
        .validate(model, _validation())
        .handle_event("iteration_completed", _halting(status, 1))
        .reduce_lr_on_plateau("validation_loss", factor=0.5, patience=1)
    )
    plain, whole = (loop.run(_data(), epochs=4, fuse=fuse) for fuse in (False, "run"))
    assert whole.history == plain.history and whole.handler_metadata == plain.handler_metadata
    assert_tree_equal(whole.step_state, plain.step_state)


def test_a_populations_early_stop_neither_restores_nor_stops_on_a_halted_epoch():
    model = fl.models.mlp([8, 3])
    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", "sgd")
        .validate(model, _validation())
        .handle_event("iteration_completed", _halting("halt_epoch", 1))
        .early_stop("validation_loss", patience=1, restore_best=True)
    )
    population = {"learning_rate": [0.3, 1.0]}
    plain, whole = (
        loop.run(_data(), epochs=4, fuse=fuse, population=population) for fuse in (False, "run")
    )
    assert whole.status == plain.status
    np.testing.assert_equal(whole.history, plain.history)  # a stopped member's NaN included
    np.testing.assert_equal(whole.handler_metadata, plain.handler_metadata)
    assert_tree_equal(whole.params, plain.params)


def test_a_dispatch_that_runs_no_step_is_an_error_not_an_endless_loop(monkeypatch):
    """A guard against a device/host disagreement turning into a hang: a dispatch whose
    segments all report zero steps would be dispatched again from the same place forever."""
    from fuseloop.engine import whole_run

    launch = whole_run.WholeRun._launch

    def ran_nothing(self, state, epoch, cursor):
        segments, host = launch(self, state, epoch, cursor)
        return segments, {**host, "n_run": np.zeros_like(host["n_run"])}

    monkeypatch.setattr(whole_run.WholeRun, "_launch", ran_nothing)
    loop = fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "sgd")
    with pytest.raises(fl.FusionError, match="from epoch 0, iteration 0 ran no step"):
        loop.run(_data(), epochs=3, fuse="run")


@pytest.mark.parametrize("event", ["iteration_started", "iteration_completed"])
def test_a_halt_inside_a_whole_run_notes_the_steps_its_state_holds(event):
    # The dispatch ran the epoch's segment whole: the State says so, as fuse=K's does, so
    # a resume from it warns that it repeats those steps.
    import jax.numpy as jnp

    def step(batch, s):
        return {"n": s["n"] + 1, "loss": jnp.mean(batch[0])}

    init = lambda batch, seed: {"n": jnp.int32(0), "loss": jnp.float32(0)}  # noqa: E731
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    data = fl.data.arrays(x, np.zeros(10, np.int32), batch_size=2, device=True)
    halt = lambda s: "halt_loop" if (s.epoch, s.iteration) == (0, 0) else None  # noqa: E731
    loop = fl.loop(step, init).metric("loss").handle_event(event, halt)
    for fuse in (5, "run"):
        state = loop.run(data, 0, epochs=2, fuse=fuse)
        assert int(state.step_state["n"]) == 5
        assert state.handler_metadata["_epoch_steps_held"] == 5, fuse
