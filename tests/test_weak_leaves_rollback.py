"""A weakly typed step-state leaf (a loss scale given as a Python float) stays weakly typed
where a fused run rolls its carry back (a halt mid-epoch undoes the epoch opened ahead),
as the unfused run keeps it: a run continued from the State then computes as the plain
loop does (`g16 / scale` stays float16)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fuseloop as fl

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(128, 4)).astype(np.float16)
Y = (X.astype(np.float32) @ _RNG.normal(size=(4, 1)).astype(np.float32)).astype(np.float16)
BAD = X.copy()
BAD[16 * 5 + 3, 0] = np.nan  # epoch 0, iteration 5: the loss is NaN


def _init() -> dict[str, Any]:
    w = (jax.random.normal(jax.random.PRNGKey(0), (4, 1)) * 0.5).astype(jnp.float16)
    return {"w": w, "scale": 1024.0, "loss": jnp.zeros((), jnp.float32)}


def _step(batch: Any, s: dict[str, Any]) -> dict[str, Any]:
    xb, yb = batch

    def scaled(w: Any) -> Any:
        loss = jnp.mean((xb @ w - yb) ** 2)
        return loss * s["scale"].astype(jnp.float16), loss

    (_, loss), g = jax.value_and_grad(scaled, has_aux=True)(s["w"])
    g = g / s["scale"]  # float16 while the scale is weakly typed
    ok = jnp.all(jnp.isfinite(g))
    return {
        "w": jnp.where(ok, s["w"] - 0.05 * g, s["w"]),
        "scale": jnp.where(ok, s["scale"], s["scale"] / 2),
        "loss": loss.astype(jnp.float32),
    }


def _data(x: np.ndarray) -> Any:
    return fl.data.arrays(x, Y, batch_size=16, shuffle=False, device=True)


def test_a_fused_halt_keeps_a_weak_leaf_weak_and_a_continued_run_equal():
    loop = fl.loop(_step).metric("loss").terminate_on_nan()
    halted = {}
    for fuse in (False, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the non-finite loss's warning
            halted[fuse] = loop.run(_data(BAD), _init(), epochs=2, fuse=fuse)
        assert halted[fuse].status == "halted"
        assert halted[fuse].step_state["scale"].weak_type
    _assert_same(halted[4], halted[False])
    plain = fl.loop(_step).metric("loss")
    go_on = {f: plain.run(_data(X), halted[f].step_state, epochs=2, fuse=f) for f in (False, 4)}
    _assert_same(go_on[4], go_on[False])
    assert go_on[4].step_state["w"].dtype == jnp.float16


def _assert_same(a: fl.State, b: fl.State) -> None:
    for u, v in zip(jax.tree.leaves(a.step_state), jax.tree.leaves(b.step_state), strict=True):
        np.testing.assert_array_equal(u, v)
