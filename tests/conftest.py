"""Shared tiny fixtures and bitwise comparison helpers for the fuseloop test suite.

Everything here is deliberately small (MLPs of a few units, batches of 4, a dozen batches)
so that the whole suite stays fast on two CPU cores. The helpers are plain functions too,
so test modules may `from conftest import ...` them for use in parametrization.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import pytest

import fuseloop as fl

EVENTS = (
    "started",
    "epoch_started",
    "iteration_started",
    "iteration_completed",
    "epoch_completed",
    "epoch_halted",
    "halted",
    "completed",
)

N_BATCHES = 12
BATCH = 4
FEATURES = 3
CLASSES = 3


# --------------------------------------------------------------------------- data
def make_batches(
    n: int = N_BATCHES,
    batch: int = BATCH,
    features: int = FEATURES,
    classes: int = CLASSES,
    seed: int = 0,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` classification batches `(x float32[batch, features], y int32[batch])`.

    The labels depend on x (argmax of a fixed projection), so a model can learn them.
    """
    rng = np.random.default_rng(seed)
    projection = rng.normal(size=(features, classes)).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch, features)).astype(np.float32)
        y = np.argmax(x @ projection, axis=-1).astype(np.int32)
        out.append((x, y))
    return out


class CountingGenerator:
    """A one-shot iterator over `batches` that counts pulls and records closing.

    `finally` of the underlying generator sets `closed`, so a test sees whether the loop
    closed it early.
    """

    def __init__(self, batches: list[Any]):
        self.batches = list(batches)
        self.pulls = 0
        self.closed = False
        self._gen = self._generate()

    def _generate(self) -> Iterator[Any]:
        try:
            for batch in self.batches:
                self.pulls += 1
                yield batch
        finally:
            self.closed = True

    def __iter__(self) -> CountingGenerator:
        return self

    def __next__(self) -> Any:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


def counting_generator(batches: list[Any], counter: dict[str, int]) -> Iterator[Any]:
    """A plain Python generator (one-shot) that counts pulls and its `finally` in `counter`."""
    try:
        for batch in batches:
            counter["pulls"] = counter.get("pulls", 0) + 1
            yield batch
    finally:
        counter["finally"] = counter.get("finally", 0) + 1


# --------------------------------------------------------------------------- models
def tiny_mlp() -> nn.Module:
    """fl.models.mlp with one hidden layer of 8 units and CLASSES outputs."""
    return fl.models.mlp([8, CLASSES])


class DropBN(nn.Module):
    """Dense -> BatchNorm -> relu -> Dropout -> Dense, with a `train` argument."""

    rate: float = 0.5

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.Dropout(self.rate, deterministic=not train)(x)
        return nn.Dense(CLASSES)(x)


class DropoutOnly(nn.Module):
    """Dropout on the input, then Dense: with a zero learning rate, only masks vary."""

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(CLASSES)(x)


def trainer(model: Any = None, optimizer: Any = "adam", **kwargs: Any) -> fl.Loop:
    """A sparse-cross-entropy trainer on `model` (default: the tiny MLP)."""
    return fl.trainer(
        tiny_mlp() if model is None else model,
        "sparse_categorical_cross_entropy",
        optimizer,
        **kwargs,
    )


def counter_loop() -> fl.Loop:
    """A metric-free custom loop: counts steps and sums the inputs (cheap to compile)."""

    def step(batch: Any, s: dict[str, Any]) -> dict[str, Any]:
        x, _ = batch
        return {"n": s["n"] + 1, "total": s["total"] + x.sum()}

    return fl.loop(step)


def counter_init() -> dict[str, Any]:
    return {"n": np.int32(0), "total": np.float32(0.0)}


# --------------------------------------------------------------------------- comparisons
def host(leaf: Any) -> np.ndarray:
    """A numpy copy of a leaf; typed PRNG keys (e.g. nnx RNG streams) as their key data."""
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


def tree_equal(a: Any, b: Any) -> bool:
    """Same structure (NamedTuple optax states included), dtypes, shapes and bits."""
    leaves_a, def_a = jax.tree.flatten(a)
    leaves_b, def_b = jax.tree.flatten(b)
    if def_a != def_b:
        return False
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = host(x), host(y)
        if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return False
    return True


def assert_tree_equal(a: Any, b: Any, what: str = "tree") -> None:
    leaves_a, def_a = jax.tree.flatten(a)
    leaves_b, def_b = jax.tree.flatten(b)
    assert def_a == def_b, f"{what}: structures differ:\n{def_a}\n{def_b}"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
    for path, x, y in zip(paths, leaves_a, leaves_b, strict=True):
        x, y = host(x), host(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (
            f"{what}{path}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        )
        if not np.array_equal(x, y):
            diff = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
            raise AssertionError(f"{what}{path} differs: max |diff| {diff}")


def assert_tree_close(
    a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6, what: str = "tree"
) -> None:
    leaves_a, def_a = jax.tree.flatten(a)
    leaves_b, def_b = jax.tree.flatten(b)
    assert def_a == def_b, f"{what}: structures differ"
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(host(x), host(y), rtol=rtol, atol=atol, err_msg=what)


def assert_runs_identical(a: fl.State, b: fl.State, step_state: bool = True) -> None:
    """Two runs agree bitwise: step state (params, opt_state, rng, step), metrics, history,
    event counts and status."""
    if step_state:
        assert_tree_equal(a.step_state, b.step_state, "step_state")
    assert a.metrics == b.metrics, f"metrics: {a.metrics} vs {b.metrics}"
    assert a.history == b.history, f"history: {a.history} vs {b.history}"
    assert a.event_counts == b.event_counts, f"event_counts: {a.event_counts} vs {b.event_counts}"
    assert a.status == b.status


def recorder(log: list, event: str, extra: Any = None):
    """A handler that appends `(event, epoch, iteration)` (plus `extra(state)`) to `log`."""

    def handler(state: fl.State) -> None:
        item = (event, state.epoch, state.iteration)
        if extra is not None:
            item = item + (extra(state),)
        log.append(item)

    return handler


def record_all(loop: fl.Loop, log: list, extra: Any = None) -> fl.Loop:
    """Attaches a recorder to all eight events."""
    for event in EVENTS:
        loop = loop.handle_event(event, recorder(log, event, extra))
    return loop


def copy_step_state(state: fl.State) -> Any:
    return jax.tree.map(host, state.step_state)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    return make_batches()


@pytest.fixture
def stream() -> io.StringIO:
    return io.StringIO()


def with_compilation_cache(env: dict[str, str]) -> dict[str, str]:
    """`env` for a python subprocess that shares the test session's persistent XLA cache
    (the root conftest.py made it): a program the tests or an earlier subprocess compiled
    is read from it, not compiled again. Results are bit for bit the same."""
    cache = os.environ.get("FUSELOOP_TEST_XLA_CACHE")
    if cache is None:  # not under the root conftest.py: nothing to share
        return env
    return {
        **env,
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def run_on_four_devices(script: str) -> dict:
    """Runs `script` in a subprocess with 4 virtual CPU devices (the device count is fixed
    when jax starts) and returns the JSON of its last `RESULT ` line."""
    env = with_compilation_cache(dict(os.environ))
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])
