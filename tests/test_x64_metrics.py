"""64-bit mode: a float64 run's metrics are summed and read in float64, not through float32
(whose range would read a finite loss as inf or 0, and whose 7 digits would hide what a
float64 model's monitors compare), fused and unfused alike."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl


def _linear() -> tuple:
    def init(rng, x):
        return {"w": jnp.ones((x.shape[-1],), x.dtype)}

    return init, lambda params, x: x @ params["w"]


@pytest.mark.parametrize("scale", [1e25, 1e-25])  # squares beyond float32's range
@pytest.mark.parametrize("fuse", [False, 4, "run"])
def test_a_float64_loss_beyond_float32s_range_reads_its_float64_value(scale, fuse):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)) * scale
    y = np.zeros(16)
    with jax.enable_x64(True):
        loop = fl.trainer(_linear(), "mean_squared_error", optax.sgd(0.0))
        loop = loop.early_stop("loss", patience=5)
        state = loop.run(fl.data.arrays(x, y, 4, shuffle=False), epochs=2, fuse=fuse)
    expected = np.mean(x.sum(1) ** 2)
    assert state.status == "completed" and sorted(state.history) == [0, 1]
    np.testing.assert_allclose(state.metrics["loss"], expected, rtol=1e-13)


def test_early_stop_under_x64_decides_on_float64_values_as_the_host_does():
    # The score falls by 1e-9 an epoch: below float32's resolution at 1.0 (6e-8), so read
    # through float32 it would not move and the run would halt after one epoch of patience.
    def init(batch, _):
        return {"step": jnp.zeros((), jnp.int32), "score": jnp.zeros((), jnp.float64)}

    def step(batch, state):
        epoch = state["step"] // 2
        score = 1.0 - 1e-9 * jnp.minimum(epoch, 3).astype(jnp.float64)
        return {"step": state["step"] + 1, "score": score}

    with jax.enable_x64(True):
        loop = fl.loop(step, init).metric("score").early_stop("score", patience=1, min_delta=5e-10)
        x = np.zeros((8, 2))
        runs = [
            loop.run(fl.data.arrays(x, x[:, 0], 4, device=True), 0, epochs=8, fuse=fuse)
            for fuse in (False, 2, "run")
        ]
    for state in runs:  # epochs 1-3 improve by 1e-9 > 5e-10; epoch 4 does not
        assert state.status == "halted" and sorted(state.history) == [0, 1, 2, 3, 4]
        assert state.handler_metadata["early_stop:score"]["best_epoch"] == 3
        assert state.history[3]["score"] == 1.0 - 3e-9
    assert runs[0].history == runs[1].history == runs[2].history


@pytest.mark.parametrize("fuse", [False, "run"])
def test_the_learning_rate_under_x64_reads_the_float64_rate_the_optimizer_holds(fuse):
    x = np.ones((8, 3))
    with jax.enable_x64(True):
        loop = fl.trainer(_linear(), "mean_squared_error", "sgd")  # its rate: 0.01
        state = loop.run(fl.data.arrays(x, x[:, 0], 4), epochs=1, fuse=fuse)
    assert state.metrics["learning_rate"] == 0.01  # not float32's 0.009999999776


def test_a_float64_state_continued_without_x64_is_refused_naming_the_mode():
    # It was narrowed to float32 and refused as a change the step made, blaming the step.
    x = np.ones((8, 3))
    with jax.enable_x64(True):
        loop = fl.trainer(_linear(), "mean_squared_error", "sgd")
        state = loop.run(fl.data.arrays(x, x[:, 0], 4), epochs=1)
    with pytest.raises(ValueError, match=r"as float64, made in JAX's 64-bit mode, which is off"):
        loop.run(fl.data.arrays(x.astype(np.float32), x[:, 0], 4), state, epochs=2)


def test_a_state_of_host_float64_leaves_resumes_narrowed_as_fresh_variables_are():
    # Only 64-bit mode makes a float64 jax array: numpy float64 params (read from a file)
    # in a State were refused as if the State came from it.
    x = np.ones((8, 3), np.float32)
    loop = fl.trainer(_linear(), "mean_squared_error", "sgd")
    state = loop.run(fl.data.arrays(x, x[:, 0], 4), epochs=1)
    host = jax.tree.map(lambda a: np.asarray(a, np.float64), state.params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # it trains as the model makes it
        resumed = loop.run(
            fl.data.arrays(x, x[:, 0], 4),
            state.replace(step_state={**state.step_state, "params": host}),
            epochs=2,
        )
    assert sorted(resumed.history) == [0, 1]


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_a_named_optimizer_keeps_each_params_width_where_float32_and_float64_mix(optimizer):
    """Under x64 flax still makes float32 params; with a float64 head beside them, the
    named optimizers' float64 hyperparameters widened the float32 params' moments, and the
    run was refused as a step that changes dtypes (optax.adam runs it)."""

    def init(rng, x):
        return {"narrow": jnp.ones((3,), jnp.float32), "wide": jnp.ones((3,), jnp.float64)}

    def apply(params, x):
        return x.astype(jnp.float32) @ params["narrow"] + x @ params["wide"]

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)), rng.normal(size=16)
    with jax.enable_x64(True):
        named = fl.trainer((init, apply), "mean_squared_error", optimizer)
        state = named.run(fl.data.arrays(x, y, 4, shuffle=False), epochs=2, fuse=2)
    moments = state.step_state["opt_state"].inner_state[0]
    assert {k: v.dtype for k, v in moments.mu.items()} == {"narrow": "float32", "wide": "float64"}
    assert np.isfinite(state.metrics["loss"])


@pytest.mark.parametrize("fuse", [False, 4, "run"])
def test_a_weakly_typed_coefficient_computes_in_float64_from_the_first_step(fuse):
    """`{"k": 1.0}` is weakly typed: beside float32 weights a plain loop's first step
    computes in float32, and its update makes k a float64 array. The run takes k as that
    array from the start, so every step, fused or not, computes in float64 (a device loop
    carried the weak k and computed every step in float32)."""
    x = np.full((16, 1), 1.0e4, np.float32)
    y = np.full(16, 1.0e4 * (1.0 + 1e-7), np.float64)

    def init(rng, x):
        return {"w": jnp.ones((1,), jnp.float32), "k": jnp.array(1.0 + 1e-7)}

    def apply(params, x):
        return params["k"] * (x @ params["w"])

    with jax.enable_x64(True):
        loop = fl.trainer((init, apply), "mean_squared_error", optax.sgd(0.0))
        seen: list[float] = []
        watched = loop.observe("iteration_completed", lambda s: seen.append(s.metrics["loss"]))
        data = fl.data.arrays(x, y, 4, shuffle=False, device=fuse == "run")
        state = watched.run(data, epochs=2, fuse=fuse)
        assert not state.params["k"].weak_type and state.params["k"].dtype == jnp.float64
    # Every step's output in float64: the error of k's last digits, not float32's 5.5e-10.
    assert len(seen) == 8 and len(set(seen)) == 1 and seen[0] < 1e-20


@pytest.mark.parametrize("fuse", [False, 2, "run"])
def test_a_weak_number_in_a_custom_state_takes_the_dtype_its_step_returns(fuse):
    """A weakly typed float the step makes a float32 array (`.astype`), and one it makes
    bfloat16 (an average of bfloat16 values), keep those dtypes from the first step:
    neither is widened to float64 (refused as a dtype the step changes) nor carried weak."""

    def step(batch, s):
        x = batch[0]
        return {
            "k": (s["k"] * 0.5).astype(jnp.float32),
            "ema": 0.5 * s["ema"] + 0.5 * jnp.mean(x.astype(jnp.bfloat16)),
        }

    x = np.full((4, 2), 1.03, np.float32)
    data = fl.data.arrays(x, x[:, 0], 4, shuffle=False, device=fuse == "run")
    with jax.enable_x64(True):
        weak = {"k": jnp.array(1.0), "ema": jnp.array(1.0)}  # weakly typed float64
        state = fl.loop(step).run(data, weak, epochs=3, fuse=fuse)
    assert state.step_state["k"].dtype == jnp.float32 and float(state.step_state["k"]) == 0.125
    assert state.step_state["ema"].dtype == jnp.bfloat16


def test_a_python_float_in_a_custom_state_computes_alike_fused_and_unfused():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype(np.float32) * 1e3, rng.normal(size=16)

    def step(batch, s):  # the float64 update makes k strong; the weak k met float32 x
        loss = jnp.mean((s["k"] * (batch[0] @ s["w"]) - batch[1]) ** 2)
        return {"w": s["w"], "k": s["k"] - jnp.float64(1e-9) * loss}

    data = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)]
    with jax.enable_x64(True):
        ends = {
            np.asarray(
                fl.loop(step)
                .run(data, {"w": jnp.ones(3, jnp.float32), "k": 1.0}, epochs=3, fuse=fuse)
                .step_state["k"]
            ).tobytes()
            for fuse in (False, 2, "run")
        }
    assert len(ends) == 1


def test_a_weakly_typed_counter_the_step_keeps_weak_stays_so():
    def step(batch, s):
        return {"n": s["n"] + 1, "scale": s["scale"]}

    state = fl.loop(step).run([(0, 0)] * 3, {"n": 0, "scale": 0.5}, fuse=2)
    assert int(state.step_state["n"]) == 3
    assert state.step_state["n"].weak_type and state.step_state["scale"].weak_type
