"""Prefetch: a bounded producer pulls the next chunks while
the device runs the current one. Checked here: the bound, exact consumption of one-shot
iterators, error propagation with the source's own type and a note, and no leftover thread."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import optax
import pytest

import fuseloop as fl

FEATURES, CLASSES, BATCH, K = 3, 2, 4, 4


def _batches(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        out.append((x, (x[:, 0] > 0).astype(np.int32)))
    return out


BATCHES = _batches(24)
LOOP = fl.trainer(fl.models.mlp([4, CLASSES]), "sparse_categorical_cross_entropy", optax.sgd(0.1))


class SourceError(Exception):
    """A data-source failure the caller must see as itself."""


class Reiterable:
    """A fresh pass each epoch; counts pulls per pass; may raise at (pass, index)."""

    def __init__(self, batches: list[Any], fail_at: tuple[int, int] | None = None):
        self.batches, self.fail_at = batches, fail_at
        self.pulled_per_pass: list[int] = []
        self.closed = 0

    def __iter__(self) -> Iterator[Any]:
        self.pulled_per_pass.append(0)
        return self._pass(len(self.pulled_per_pass) - 1)

    def _pass(self, number: int) -> Iterator[Any]:
        try:
            for index, batch in enumerate(self.batches):
                if (number, index) == self.fail_at:
                    raise SourceError(f"bad record in pass {number} at {index}")
                self.pulled_per_pass[-1] += 1
                yield batch
        finally:
            self.closed += 1


def counting_generator(
    batches: list[Any], log: dict[str, Any], fail_at: int | None = None
) -> Iterator[Any]:
    """A one-shot generator: `log["pulled"]` counts pulls, `log["closed"]` its finally."""
    log.update(pulled=0, closed=False)
    try:
        for index, batch in enumerate(batches):
            if index == fail_at:
                raise SourceError(f"bad record {index}")
            log["pulled"] += 1
            yield batch
    finally:
        log["closed"] = True


def _steps(state) -> int:
    return int(state.step_state["step"])


def _our_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


# --------------------------------------------------------------------- the bound
@pytest.mark.parametrize("depth", [2, 1])
def test_reiterable_is_pulled_at_most_depth_chunks_ahead(depth):
    source = Reiterable(BATCHES)
    seen: list[tuple[int, int]] = []

    def watch(state):
        i = state.iteration
        if i % K == 0:
            time.sleep(0.002)  # gives an unbounded producer the time to run ahead
        seen.append((i, source.pulled_per_pass[-1]))

    loop = LOOP.handle_event("iteration_completed", watch)
    kwargs = {} if depth == 2 else {"prefetch": depth}
    state = loop.run(source, epochs=2, fuse=K, **kwargs)
    assert _steps(state) == 2 * len(BATCHES) and len(seen) == 2 * len(BATCHES)
    for i, pulled in seen:
        stepped = (i // K + 1) * K  # when iteration i replays, its whole chunk has run
        assert pulled <= stepped + depth * K, (i, pulled)


def test_pulls_never_pass_the_iteration_bound_of_an_epoch():
    source = Reiterable(BATCHES)
    state = LOOP.run(source, epochs=3, iterations=10, fuse=K)
    assert _steps(state) == 30 and source.pulled_per_pass == [10, 10, 10]
    assert source.closed == 3


def test_prefetch_zero_pulls_no_chunk_ahead():
    source = Reiterable(BATCHES)
    seen: list[tuple[int, int]] = []
    loop = LOOP.handle_event(
        "iteration_completed", lambda s: seen.append((s.iteration, source.pulled_per_pass[-1]))
    )
    loop.run(source, epochs=1, fuse=K, prefetch=0)
    for i, pulled in seen:
        assert pulled <= (i // K + 1) * K + K  # at most the chunk about to run


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_prefetch_values_raise(bad):
    with pytest.raises(ValueError, match="prefetch"):
        LOOP.run(BATCHES, fuse=K, prefetch=bad)


# --------------------------------------------------------------------- exact consumption
@pytest.mark.parametrize("status, steps", [("halt_loop", 8), ("halt_epoch", 24)])
def test_one_shot_with_an_iteration_handler_is_consumed_exactly(status, steps):
    log: dict[str, Any] = {}
    halts = lambda s: status  # noqa: E731
    loop = LOOP.handle_event("iteration_completed", halts, filter={"once": 6})
    state = loop.run(counting_generator(BATCHES, log), epochs=2, fuse=K)
    # the halt takes effect at the end of the chunk holding iteration 5, i.e. after 8 steps
    assert _steps(state) == steps and log["pulled"] == steps and log["closed"]


def test_one_shot_without_handlers_never_prefetches_across_an_epoch():
    log: dict[str, Any] = {}
    state = LOOP.run(counting_generator(BATCHES, log), epochs=3, iterations=6, fuse=K)
    assert _steps(state) == 18 and log["pulled"] == 18 and log["closed"]


def test_one_shot_with_a_handler_is_never_pulled_ahead_of_its_chunk():
    log: dict[str, Any] = {}
    seen: list[tuple[int, int]] = []
    loop = LOOP.handle_event(
        "iteration_completed", lambda s: seen.append((s.iteration, log["pulled"]))
    )
    loop.run(counting_generator(BATCHES, log), epochs=1, fuse=K)
    for i, pulled in seen:
        assert pulled == (i // K + 1) * K


# --------------------------------------------------------------------- errors
def _assert_source_error(info: Any, epoch: int, iteration: int) -> None:
    error = info.value
    notes = " ".join(getattr(error, "__notes__", []))
    assert f"epoch {epoch}" in notes and f"iteration {iteration}" in notes, notes
    frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    assert "_pass" in frames or "counting_generator" in frames  # the source's own frame


@pytest.mark.parametrize("fuse", [False, K])
def test_reiterable_error_mid_epoch_reaches_the_caller_with_a_note(fuse):
    before = _our_threads()
    source = Reiterable(BATCHES, fail_at=(1, 6))
    with pytest.raises(SourceError, match="bad record") as info:
        LOOP.run(source, epochs=3, fuse=fuse)
    _assert_source_error(info, epoch=1, iteration=6)
    assert _our_threads() <= before
    assert source.closed == 2


@pytest.mark.parametrize("fuse", [False, K])
def test_one_shot_error_names_the_epoch_and_iteration(fuse):
    log: dict[str, Any] = {}
    before = _our_threads()
    with pytest.raises(SourceError) as info:
        LOOP.run(counting_generator(BATCHES, log, fail_at=13), epochs=3, iterations=5, fuse=fuse)
    _assert_source_error(info, epoch=2, iteration=3)
    assert _our_threads() <= before


def test_error_at_the_first_batch_of_a_resumed_run_names_its_epoch():
    first = LOOP.run(BATCHES[:4], epochs=2)
    source = Reiterable(BATCHES, fail_at=(0, 0))
    with pytest.raises(SourceError) as info:
        LOOP.run(source, first, epochs=4, fuse=K)
    _assert_source_error(info, epoch=2, iteration=0)


# --------------------------------------------------------------------- threads
@pytest.mark.parametrize("kind", ["reiterable", "callable", "one_shot"])
def test_no_thread_outlives_a_completed_or_halted_run(kind):
    def make():
        if kind == "reiterable":
            return Reiterable(BATCHES)
        if kind == "callable":
            return lambda: iter(BATCHES)
        return counting_generator(BATCHES, {})

    before = _our_threads()
    LOOP.run(make(), epochs=2, fuse=K)
    assert _our_threads() <= before
    halting = LOOP.handle_event("iteration_completed", lambda s: "halt_loop", filter={"once": 3})
    halting.run(make(), epochs=2, fuse=K)
    assert _our_threads() <= before


def test_no_thread_outlives_a_handler_exception():
    before = _our_threads()

    def boom(state):
        raise ZeroDivisionError("handler")

    loop = LOOP.handle_event("iteration_completed", boom, filter={"once": 5})
    with pytest.raises(ZeroDivisionError):
        loop.run(Reiterable(BATCHES), epochs=2, fuse=K)
    assert _our_threads() <= before
