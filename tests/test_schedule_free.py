"""optax's schedule-free optimizers train a point that is not the one to evaluate: a
trainer says so once, naming optax's function for the evaluation point."""

from __future__ import annotations

import warnings

import numpy as np
import optax
import pytest

import fuseloop as fl

_RNG = np.random.default_rng(0)
_DATA = [(_RNG.normal(size=(8, 4)).astype(np.float32), _RNG.integers(0, 2, 8)) for _ in range(3)]


def test_a_schedule_free_optimizer_warns_once_naming_its_evaluation_params():
    model = fl.models.mlp([2])
    tx = optax.contrib.schedule_free_adamw(1e-2)
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", tx)
    with pytest.warns(UserWarning, match=r"schedule_free_eval_params\(state.step_state"):
        state = loop.run(_DATA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.run(_DATA, state, epochs=2)  # once per Loop
    evaluated = optax.contrib.schedule_free_eval_params(
        state.step_state["opt_state"], state.params["params"]
    )
    assert fl.evaluator(model).run(_DATA, {"params": evaluated}).status == "completed"


def test_other_optimizers_do_not_warn():
    loop = fl.trainer(fl.models.mlp([2]), "sparse_categorical_cross_entropy", "adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.run(_DATA)
