"""Fused == unfused, bitwise on CPU: parameters, optimizer state, RNG and
step counter, metrics, history, event counts, and log output byte for byte."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import (
    DropBN,
    assert_runs_identical,
    assert_tree_equal,
    counter_init,
    counter_loop,
    make_batches,
    tiny_mlp,
    trainer,
)

DATA = make_batches(12)
KS = [1, 4, 5, 12, 32]  # K=1, K divides 12, does not divide, equals, exceeds the epoch

# Named adam: its optimizer state is an optax NamedTuple holding injected hyperparams.
MLP_LOOP = trainer(optimizer="adam").metric("accuracy")


@pytest.fixture(scope="module")
def unfused():
    return MLP_LOOP.run(DATA, epochs=2)


@pytest.mark.parametrize("fuse", KS + [True], ids=[f"K{k}" for k in KS] + ["True"])
def test_trainer_with_accuracy(unfused, fuse):
    fused = MLP_LOOP.run(DATA, epochs=2, fuse=fuse)
    assert_runs_identical(unfused, fused)
    assert fused.stats["chunk_size"] == (32 if fuse is True else fuse)


@pytest.mark.parametrize("fuse", [4, 5, 32])
def test_trainer_with_iterations_bound(fuse):
    reference = MLP_LOOP.run(DATA, epochs=2, iterations=7)
    fused = MLP_LOOP.run(DATA, epochs=2, iterations=7, fuse=fuse)
    assert_runs_identical(reference, fused)
    assert fused.event_counts["iteration_completed"] == {"total": 14, "epoch": 7}


def test_trainer_over_other_data_sources(unfused):
    # A one-shot generator is consumed across epochs: `iterations` splits it into epochs.
    generator = MLP_LOOP.run((b for b in DATA * 2), epochs=2, iterations=12, fuse=5)
    callable_source = MLP_LOOP.run(lambda: iter(DATA), epochs=2, fuse=5)
    assert_runs_identical(unfused, generator)
    assert_runs_identical(unfused, callable_source)


DROPBN_LOOP = trainer(DropBN(), optax.adam(0.01)).metric("accuracy")


@pytest.fixture(scope="module")
def dropbn_unfused():
    return DROPBN_LOOP.run(DATA, epochs=2)


@pytest.mark.parametrize("fuse", [5, 32])
def test_dropout_and_batchnorm_model(dropbn_unfused, fuse):
    fused = DROPBN_LOOP.run(DATA, epochs=2, fuse=fuse)
    assert_runs_identical(dropbn_unfused, fused)
    assert not np.allclose(dropbn_unfused.params["batch_stats"]["BatchNorm_0"]["var"], 1.0)


def test_evaluator(unfused):
    loop = fl.evaluator(tiny_mlp()).metric("accuracy")
    params = jax.tree.map(np.array, unfused.params)
    reference = loop.run(DATA, params, epochs=2)
    for fuse in (5, 32):
        assert_runs_identical(reference, loop.run(DATA, params, epochs=2, fuse=fuse))
        assert_runs_identical(reference, loop.run(DATA, unfused, epochs=2, fuse=fuse))
    assert_tree_equal(unfused.params, params)  # the evaluator leaves its input alone


@pytest.mark.parametrize("fuse", [4, 5, 32])
def test_metric_free_custom_loop(fuse):
    loop = counter_loop()
    reference = loop.run(DATA, counter_init(), epochs=2)
    fused = loop.run(DATA, counter_init(), epochs=2, fuse=fuse)
    assert_runs_identical(reference, fused)
    assert fused.metrics == {} and int(fused.step_state["n"]) == 24


def test_custom_loop_with_a_scalar_metric():
    def step(batch, s):
        x, y = batch
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(s["w"])
        return {"w": s["w"] - 0.05 * grad, "loss": loss}

    init = {"w": np.ones(3, np.float32), "loss": np.float32(0)}
    loop = fl.loop(step).metric("loss")
    reference = loop.run(DATA, init, epochs=2)
    for fuse in (5, 32):
        assert_runs_identical(reference, loop.run(DATA, init, epochs=2, fuse=fuse))


def _mean_with_many_readers(batch, s):
    """A step whose `jnp.mean` several metrics read: XLA rounded it otherwise in the
    unfused and multi-epoch programs, which dropped the loop's unread records (and with
    them the index their writes shared with the step's kernels)."""
    m = jnp.mean(batch[0])
    return {
        "n": s["n"] + 1,
        "bf": (m * 3).astype(jnp.bfloat16),
        "flag": m > 0,
        "f16": m.astype(jnp.float16),
        "loss": m,
        "acc": s["acc"] + m,
    }


@pytest.mark.parametrize("device", [False, True], ids=["host", "resident"])
def test_a_reduction_read_by_several_metrics_rounds_alike_in_every_program(device):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 2)).astype(np.float32), np.zeros(24, np.float32)
    init = {
        "n": jnp.int32(0),
        "bf": jnp.bfloat16(0),
        "flag": jnp.bool_(False),
        "f16": jnp.float16(0),
        "loss": jnp.float32(0),
        "acc": jnp.float32(0),
    }
    loop = fl.loop(_mean_with_many_readers)
    for name in ("n", "bf", "flag", "f16", "loss"):
        loop = loop.metric(name)
    runs = {
        fuse: loop.run(
            fl.data.arrays(x, y, batch_size=4, shuffle=False, device=device),
            init,
            epochs=2,
            fuse=fuse,
        )
        for fuse in (False, 3, "run")
    }
    for fuse in (3, "run"):
        assert_runs_identical(runs[False], runs[fuse])


class Redirect:
    """A log stream whose target can be swapped, so one Loop serves several runs."""

    def __init__(self) -> None:
        self.target = io.StringIO()

    def write(self, text: str) -> int:
        return self.target.write(text)

    def flush(self) -> None:
        pass


def test_log_output_is_byte_identical():
    stream = Redirect()
    loop = fl.trainer(
        tiny_mlp(), "sparse_categorical_cross_entropy", "adam", log=3, log_stream=stream
    ).metric("accuracy")
    outputs, states = {}, {}
    for fuse in (False, 5, 32):
        stream.target = io.StringIO()
        states[fuse] = loop.run(DATA, epochs=2, fuse=fuse)
        outputs[fuse] = stream.target.getvalue()
    # 8 iteration lines (every 3 of 24) and one summary line per epoch, each newline-terminated.
    assert outputs[False].count(" - iteration ") == 8 and outputs[False].count("\n") == 10
    assert outputs[5] == outputs[False]
    assert outputs[32] == outputs[False]
    assert_runs_identical(states[False], states[5])
    assert_runs_identical(states[False], states[32])
