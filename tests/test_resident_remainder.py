"""Device-resident `fl.data.arrays` whose size the batch does not divide: the remainder is
dropped, or (drop_remainder=False) run as a short last batch, exactly as the host source."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, trainer

N, BATCH, FEATURES = 70, 16, 3  # four full batches and a short one of 6
LOOP = trainer().metric("accuracy")


def _arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    return x, (x.sum(axis=1) > 0).astype(np.int32) + (x[:, 0] > 1).astype(np.int32)


def _source(device: bool, drop_remainder: bool, shuffle: bool = True) -> Any:
    x, y = _arrays()
    try:
        return fl.data.arrays(
            x,
            y,
            batch_size=BATCH,
            seed=5,
            shuffle=shuffle,
            drop_remainder=drop_remainder,
            device=device,
        )
    except ValueError as error:
        if device and "device=True needs every batch full" in str(error):
            pytest.skip("fl.data.arrays still refuses device=True with a remainder")
        raise


def _same_run(a: fl.State, b: fl.State) -> None:
    assert_tree_equal(a.step_state, b.step_state, "step_state")
    assert a.history == b.history
    assert a.event_counts == b.event_counts


@pytest.mark.parametrize("fuse", [False, 2, 4, 32])
def test_drop_remainder_drops_it_as_the_host_does(fuse: Any) -> None:
    host = LOOP.run(_source(False, True), epochs=2)
    resident = LOOP.run(_source(True, True), epochs=2, fuse=fuse)
    _same_run(resident, host)
    assert resident.event_counts["iteration_completed"]["epoch"] == N // BATCH
    assert resident.stats["h2d_transfers"] == 1


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("fuse", [False, 2, 3, 4, 32])
def test_the_short_last_batch_runs_as_on_the_host(fuse: Any, shuffle: bool) -> None:
    # The host source runs a short batch unfused only (a fused chunk needs one shape).
    host = LOOP.run(_source(False, False, shuffle), epochs=3)
    resident = LOOP.run(_source(True, False, shuffle), epochs=3, fuse=fuse)
    _same_run(resident, host)
    assert resident.event_counts["iteration_completed"]["epoch"] == N // BATCH + 1
    assert resident.stats["h2d_transfers"] == 1


def test_the_short_batch_sees_iteration_handlers_in_order() -> None:
    seen: dict[Any, list[tuple[int, int, float]]] = {}
    for fuse in (False, 3):
        log: list[tuple[int, int, float]] = []
        loop = LOOP.handle_event(
            "iteration_completed",
            lambda s, log=log: log.append((s.epoch, s.iteration, s.metrics["loss"])),
        )
        loop.run(_source(True, False), epochs=2, fuse=fuse)
        seen[fuse] = log
    assert seen[False] == seen[3]
    assert [i for e, i, _ in seen[3] if e == 1] == [0, 1, 2, 3, 4]


def test_an_iterations_bound_below_the_short_batch_leaves_it_out() -> None:
    host = LOOP.run(_source(False, False), epochs=2, iterations=3)
    resident = LOOP.run(_source(True, False), epochs=2, iterations=3, fuse=2)
    _same_run(resident, host)


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_short_last_batch_is_warned_of_as_the_host_warns(fuse: Any) -> None:
    # The host never sees a resident batch: the run warned of none, where the host
    # source's unfused run warns of the short batch's compile and weighing.
    with pytest.warns(UserWarning, match=r"last batch of each epoch has batch size 6 instead"):
        LOOP.run(_source(True, False), epochs=2, fuse=fuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LOOP.run(_source(True, False), epochs=2, iterations=4, fuse=fuse)  # not reached
        evaluator = fl.evaluator(fl.models.mlp([8, 3])).metric("accuracy")  # expected there
        evaluator.run(_source(True, False, shuffle=False), LOOP.run(_source(True, True)).params)
