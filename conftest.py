"""The names the docstring examples under src/fuseloop share (pytest --doctest-modules).

Each example may use `fl`, `np`, `jnp`, `jax`, `optax`, and a tiny classification task:
`model` (an MLP), `batches` and `val_batches` (lists of (x, y) pairs: 8 examples of 4
features, 3 classes), and `loop` (a trainer for them).

This file sits at the repository root, outside the package (so not in the wheel), and is
loaded before tests/conftest.py, whose helpers the tests import as `conftest`: the
conftest imported last is the one `import conftest` finds.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl

# `pytester` runs a pytest session inside a test (tests/test_bench_scripts.py runs the
# bench/suite_compiles.py plugin that way).
pytest_plugins = ("pytester",)

# Every test builds its loops afresh, so the suite compiles the same small programs over and
# over (about half its time). A persistent XLA cache shared by the test processes (the
# pytest-xdist workers inherit the variable from the controller, which made the directory)
# turns each repeat into a read of the same executable; results are bit for bit the same.
_XLA_CACHE_VAR = "FUSELOOP_TEST_XLA_CACHE"
_OWN_CACHE = _XLA_CACHE_VAR not in os.environ
if _OWN_CACHE:
    os.environ[_XLA_CACHE_VAR] = tempfile.mkdtemp(prefix="fuseloop-xla-")
jax.config.update("jax_compilation_cache_dir", os.environ[_XLA_CACHE_VAR])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config: pytest.Config) -> None:
    """Python's garbage collector, tuned for a process that traces JAX programs all day.

    Tracing makes a great many short-lived objects beside a large long-lived heap (the
    imported libraries, JAX's caches), and the default thresholds made the collector walk
    that heap over and over: about a fifth of the CPU time of a test file with a warm XLA
    cache. What exists once the plugins are loaded is frozen out of collection, and a
    collection starts after 20,000 net allocations rather than 700. Tests that count what
    is left alive call `gc.collect()` themselves.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The process that made the cache directory removes it when the session ends."""
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ[_XLA_CACHE_VAR], ignore_errors=True)


# The suite's longest files (a minute or more of compiling or subprocesses on two cores),
# started first: pytest-xdist hands each worker one file at a time in collection order, and
# a long file collected last (test_whole_run.py sorts late) keeps one core busy while the
# other has nothing left to take.
_LONG_FILES = (
    "test_whole_run.py",
    "test_multiprocess.py",
    "test_examples.py",
    "test_population_whole_run.py",
    "test_bench_smoke.py",
    "test_population.py",
    "test_model_modes.py",
    "test_trainer.py",
    "test_whole_run_checkpoint.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves the files of `_LONG_FILES` to the front, in that order (the rest keep theirs)."""
    rank = {name: index for index, name in enumerate(_LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _batches(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, size=8).astype(np.int32))
        for _ in range(count)
    ]


@pytest.fixture(autouse=True)
def _example_names(request: pytest.FixtureRequest) -> None:
    if type(request.node).__name__ != "DoctestItem":  # the tests build their own data
        return
    model = fl.models.mlp([8, 3])
    request.getfixturevalue("doctest_namespace").update(
        fl=fl,
        np=np,
        jnp=jnp,
        jax=jax,
        optax=optax,
        model=model,
        batches=_batches(0, 4),
        val_batches=_batches(1, 2),
        loop=fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.1)),
    )
