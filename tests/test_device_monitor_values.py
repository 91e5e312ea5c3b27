"""A monitored metric read on the device is the value the host reads from the same sums.

The device monitors (early stopping, plateaus, checkpoint-on-best inside a multi-epoch
dispatch) decide on a value computed on the device, and the host checks that it decides
the same; a value one ulp off turns a tie into an improvement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from fuseloop._metrics import read_metric
from fuseloop.engine.device_compare import beats_best
from fuseloop.engine.device_monitors import device_value
from fuseloop.handlers._monitor_record import Monitor


class _Mean:
    accumulate = "mean"


def _acc(total, count):
    """An accumulator holding `total` over `count`, its compensations zero."""
    zero = np.float32(0)
    return {"sum": total, "count": count, "sum_error": zero, "count_error": zero}


def test_a_mean_over_a_count_known_when_compiled_is_the_hosts_value():
    # A validation set's count is a constant of the program: XLA would multiply by its
    # reciprocal (39/44 came out 0.8863636851 against the host's 0.8863636255).
    mismatched = []
    for count in range(1, 60):
        known = jnp.float32(count)
        read = jax.jit(lambda total, c=known: device_value(_Mean, _acc(total, c)))
        for total in range(count + 1):
            host = read_metric(_Mean, _acc(np.float32(total), np.float32(count)))
            if float(read(jnp.float32(total))) != host:
                mismatched.append((total, count))
    assert mismatched == []


def test_a_populations_means_over_one_shared_count_are_the_hosts_values():
    totals = np.arange(45, dtype=np.float32)
    read = jax.jit(lambda t: device_value(_Mean, _acc(t, jnp.float32(44))))
    np.testing.assert_array_equal(np.asarray(read(totals)), totals / np.float32(44))


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("min_delta", [0.1, 1e-3, 0.3, 2.5])
def test_an_improvement_by_min_delta_is_decided_on_the_device_as_the_host_decides(mode, min_delta):
    # The host compares value +/- min_delta with best in float64: rounded to float32 first,
    # 0.9 + 0.1 would be 1.0f, and 0.9f would not beat 1.0f. Values a few float32 steps
    # around each threshold, over bests of many magnitudes.
    monitor = Monitor("loss", mode, 1, min_delta, "key")
    rng = np.random.default_rng(0)
    bests = (rng.normal(size=64) * 10.0 ** rng.integers(-2, 3, 64)).astype(np.float32)
    bests = np.concatenate([bests, np.float32([1.0, 0.5, 2.0, 10.0])])
    sign = -1.0 if mode == "min" else 1.0
    near = np.float32(bests.astype(np.float64) + sign * min_delta)
    steps = [np.nextafter(near, np.float32(np.inf * k)) if k else near for k in (-1, 0, 1)]
    values = np.stack([*steps, np.nextafter(steps[0], -np.inf), np.nextafter(steps[2], np.inf)])
    best_grid = np.broadcast_to(bests, values.shape)

    def beats(value, best):
        return beats_best(monitor, value, {"best": best, "has_best": jnp.bool_(True)})

    device = np.asarray(jax.jit(beats)(values, best_grid))
    host = np.vectorize(lambda v, b: monitor.improves(float(v), float(b)))(values, best_grid)
    np.testing.assert_array_equal(device, host)


def test_early_stop_with_a_min_delta_ends_a_whole_run_where_the_host_run_ends():
    def init(batch, _):
        return {"step": jnp.zeros((), jnp.int32), "score": jnp.zeros((), jnp.float32)}

    def step(batch, state):  # the monitored score: 1.0 in epoch 0, 0.9 after
        score = jnp.where(state["step"] < 1, jnp.float32(1.0), jnp.float32(0.9))
        return {"step": state["step"] + 1, "score": score}

    loop = fl.loop(step, init).metric("score").early_stop("score", patience=1, min_delta=0.1)
    x = np.zeros((8, 2), np.float32)
    runs = [
        loop.run(fl.data.arrays(x, x[:, 0], 8, device=True), 0, epochs=4, fuse=fuse)
        for fuse in (False, "run")
    ]
    assert runs[1].stats["dispatches"] == 1
    for state in runs:  # 0.9 beats 1.0 by more than 0.1 in float64: epoch 1 improves
        assert state.status == "halted" and sorted(state.history) == [0, 1, 2]
        assert state.handler_metadata["early_stop:score"]["best_epoch"] == 1


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("min_delta", [0.1, 1e-3, 1e-12])
def test_under_x64_an_improvement_is_decided_in_float64_as_the_host_decides(mode, min_delta):
    # Metrics read in float64: the host's `value +/- min_delta` rounded to float64, not the
    # float32 two-sum's exact difference (which would decide otherwise at the threshold).
    monitor = Monitor("loss", mode, 1, min_delta, "key")
    rng = np.random.default_rng(1)
    bests = rng.normal(size=64) * 10.0 ** rng.integers(-2, 3, 64)
    near = bests + (-1.0 if mode == "min" else 1.0) * min_delta
    values = np.stack([np.nextafter(near, -np.inf), near, np.nextafter(near, np.inf)])
    best_grid = np.broadcast_to(bests, values.shape)

    def beats(value, best):
        return beats_best(monitor, value, {"best": best, "has_best": jnp.bool_(True)})

    with jax.enable_x64(True):
        device = np.asarray(jax.jit(beats)(values, best_grid))
    host = np.vectorize(lambda v, b: monitor.improves(float(v), float(b)))(values, best_grid)
    np.testing.assert_array_equal(device, host)
