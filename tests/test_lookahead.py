"""Two chunks ahead of a waiting replay: when a handler fires in chunk n, the engine launches
chunk n+1 before it waits for n's records, and (with `prefetch` of 2 or more) prepares n+2
too, so that once the wait ends the host only launches it. Checked here: a run is the same
as with one chunk ahead (`prefetch=1`), a halt drops the chunk prepared ahead, a batch
that fails two chunks ahead is raised only after the chunks before it were replayed, and
a source read by the producer thread is never pulled past `prefetch` chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import optax
import pytest

import fuseloop as fl
from fuseloop.engine import epoch as epoch_module
from fuseloop.engine import feeds as feeds_module
from fuseloop.engine import replay as replay_module

FEATURES, CLASSES, BATCH, K, N = 3, 2, 4, 4, 14


def _batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        out.append((x, (x[:, 0] > 0).astype(np.int32)))
    return out


BATCHES = _batches(N)


class SourceError(Exception):
    """The data source's own failure."""


class InMemory:
    """A re-iterable the loop reads on its own thread (`in_memory`, like a list), which
    may raise at batch `fail_at` of every pass."""

    in_memory = True

    def __init__(self, batches: list[Any], fail_at: int | None = None):
        self.batches, self.fail_at = batches, fail_at

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.batches):
            if index == self.fail_at:
                raise SourceError(f"bad record at {index}")
            yield batch


def _loop(seen: list[tuple[int, int]], every: int, halt_at: int | None = None) -> fl.Loop:
    def handler(state: fl.State) -> Any:
        seen.append((state.epoch, state.iteration))
        return "halt_loop" if state.iteration == halt_at else None

    loop = fl.trainer(
        fl.models.mlp([4, CLASSES]), "sparse_categorical_cross_entropy", optax.adam(1e-2)
    )
    return loop.handle_event("iteration_completed", handler, {"every": every})


@pytest.fixture
def counts(monkeypatch):
    """`{"taken": [...], "prepared": [n]}`: for each chunk `EpochLoop` asked for, whether
    it was one prepared two ahead; and how many chunks the host feed prepared.

    Every chunk counts as still running when its replay starts: on a CPU a tiny model's
    chunk is often done by then, and a done chunk is replayed before anything launches.
    """
    monkeypatch.setattr(replay_module.ChunkResult, "done", lambda self: False)
    seen: dict[str, list[Any]] = {"taken": [], "prepared": [0]}
    prepare, feed_next = epoch_module.EpochLoop._prepare, feeds_module.HostFeed.next

    def counting_prepare(self: Any, first: int) -> Any:
        seen["taken"].append(self.stashed is not None)
        return prepare(self, first)

    def counting_next(self: Any, first: int) -> Any:
        seen["prepared"][0] += 1
        return feed_next(self, first)

    monkeypatch.setattr(epoch_module.EpochLoop, "_prepare", counting_prepare)
    monkeypatch.setattr(feeds_module.HostFeed, "next", counting_next)
    return seen


def _same(a: fl.State, b: fl.State) -> None:
    for x, y in zip(jax.tree.leaves(a.step_state), jax.tree.leaves(b.step_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.history == b.history and (a.epoch, a.iteration) == (b.epoch, b.iteration)


@pytest.mark.parametrize("data", [BATCHES, InMemory(BATCHES)], ids=["list", "in_memory"])
def test_two_ahead_equals_one_ahead_and_unfused(data, counts):
    seen: dict[Any, list[tuple[int, int]]] = {1: [], 2: [], "unfused": []}
    two = _loop(seen[2], every=5).run(data, epochs=2, fuse=K, prefetch=2)
    assert any(counts["taken"]), "no chunk was prepared two ahead"
    one = _loop(seen[1], every=5).run(data, epochs=2, fuse=K, prefetch=1)
    unfused = _loop(seen["unfused"], every=5).run(data, epochs=2)
    _same(two, one)
    _same(two, unfused)
    assert seen[2] == seen[1] == seen["unfused"]
    assert {epoch for epoch, _ in seen[2]} == {0, 1}


def test_a_halt_drops_the_chunk_prepared_two_ahead(counts):
    seen: dict[int, list[tuple[int, int]]] = {1: [], 2: []}
    # The handler halts at iteration 1: the halt takes effect at the end of chunk 0, with
    # chunk 1 launched ahead (rolled back) and chunk 2 prepared ahead (dropped).
    two = _loop(seen[2], every=1, halt_at=1).run(BATCHES, epochs=2, fuse=K, prefetch=2)
    assert counts["prepared"] == [3]  # chunks 0, 1 and 2
    one = _loop(seen[1], every=1, halt_at=1).run(BATCHES, epochs=2, fuse=K, prefetch=1)
    assert counts["prepared"] == [5]  # chunks 0 and 1
    _same(two, one)
    assert two.status == "halted" and two.iteration == 1  # the last iteration fired
    assert two.stats["dispatches"] == one.stats["dispatches"] == 1
    assert seen[2] == seen[1] == [(0, 0), (0, 1)]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_batch_failing_two_chunks_ahead_is_raised_after_the_replays_before_it(prefetch, counts):
    seen: list[tuple[int, int]] = []
    # Batch 9 is in chunk 2 (batches 8-11): preparing it fails while chunk 0 is replayed.
    # Chunk 2 is cut short to batch 8, which is stepped after chunk 1, as unfused.
    with pytest.raises(SourceError, match="bad record at 9") as info:
        _loop(seen, every=1).run(InMemory(BATCHES, fail_at=9), fuse=K, prefetch=prefetch)
    assert any(counts["taken"]) == (prefetch == 2)
    assert seen == [(0, i) for i in range(2 * K + 1)]  # every step before batch 9 replayed
    reached = info.value.fuseloop_state  # type: ignore[attr-defined]
    assert (reached.epoch, reached.iteration) == (0, 2 * K)


class Counted:
    """A re-iterable read by the producer thread (not in memory) that counts its pulls."""

    def __init__(self, batches: list[Any]):
        self.batches, self.pulled = batches, 0

    def __iter__(self) -> Iterator[Any]:
        self.pulled = 0
        for batch in self.batches:
            self.pulled += 1
            yield batch


def test_with_a_producer_thread_nothing_is_pulled_past_prefetch(counts):
    # The producer already holds `prefetch` chunks and counts the last one it handed out;
    # taking one more from it ahead of a replay would let it pull a chunk past its bound.
    source = Counted(BATCHES)
    seen: list[tuple[int, int]] = []
    loop = _loop([], every=1).observe(
        "iteration_completed", lambda s: seen.append((s.iteration, source.pulled))
    )
    loop.run(source, fuse=K, prefetch=2)
    assert not any(counts["taken"]) and len(seen) == N
    for i, pulled in seen:
        stepped = (i // K + 1) * K  # when iteration i replays, its whole chunk has run
        assert pulled <= stepped + 2 * K, (i, pulled)
