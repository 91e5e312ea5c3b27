"""reduce_lr_on_plateau on an optimizer whose state depends on the params' structure
(`optax.masked`, `multi_transform` with pytree labels): whether its rate can be changed is
only known on the params, so the run checks it before its first step, in every fuse mode.
A whole run used to train on with reductions that never took effect (the device's twin of
the handler skipped the check), and the host modes refused only at the first reduction."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import fuseloop as fl

_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(48, 8)).astype(np.float32)
_Y = _RNG.integers(0, 3, 48).astype(np.int32)
_MASK = {"Dense_0": {"kernel": True, "bias": False}, "Dense_1": {"kernel": True, "bias": False}}
_MODES = [(False, False), (3, False), ("run", True)]  # (fuse, device-resident data)


def _loop(tx: optax.GradientTransformation) -> fl.Loop:
    model = fl.models.mlp([16, 3])
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", tx)
    return loop.reduce_lr_on_plateau("loss", factor=0.5, patience=1, min_delta=10.0)


def _steps(counted: list[int]):
    def count(state: fl.State) -> None:
        counted.append(state.iteration)

    return count


@pytest.mark.parametrize(("fuse", "device"), _MODES)
def test_a_scheduled_rate_under_a_pytree_mask_is_refused_before_the_first_step(fuse, device):
    schedule = optax.linear_schedule(0.01, 0.001, 30)
    tx = optax.masked(optax.inject_hyperparams(optax.adam)(learning_rate=schedule), _MASK)
    counted: list[int] = []
    loop = _loop(tx).observe("iteration_completed", _steps(counted))
    data = fl.data.arrays(_X, _Y, batch_size=8, device=device)
    for _ in range(2):  # a second run of the same loop is refused too
        with pytest.raises(ValueError, match="it is an optax schedule"):
            loop.run(data, epochs=4, fuse=fuse)
    assert counted == []


@pytest.mark.parametrize(("fuse", "device"), _MODES)
def test_a_fixed_rate_under_pytree_labels_is_refused_before_the_first_step(fuse, device):
    labels = {k: {"kernel": "a", "bias": "b"} for k in _MASK}
    tx = optax.multi_transform({"a": optax.adam(1e-2), "b": optax.sgd(1e-2)}, labels)
    counted: list[int] = []
    loop = _loop(tx).observe("iteration_completed", _steps(counted))
    with pytest.raises(ValueError, match="fixed inside the optax transformation"):
        loop.run(fl.data.arrays(_X, _Y, batch_size=8, device=device), epochs=4, fuse=fuse)
    assert counted == []


def test_an_injected_constant_rate_under_a_pytree_mask_is_still_reduced():
    tx = optax.masked(optax.inject_hyperparams(optax.adam)(learning_rate=0.01), _MASK)
    state = _loop(tx).run(fl.data.arrays(_X, _Y, batch_size=8), epochs=4)
    rate = state.step_state["opt_state"].inner_state.hyperparams["learning_rate"]
    assert float(rate) == pytest.approx(0.01 * 0.5**3)  # reduced after epochs 1, 2 and 3


def test_an_injected_rate_under_another_name_is_named_in_the_refusal():
    tx = optax.inject_hyperparams(lambda lr: optax.adam(lr))(lr=1e-2)
    with pytest.raises(ValueError, match=r"inject_hyperparams holds \['lr'\]: name the rate"):
        _loop(tx)
