"""The device loop's two forms (docs/design.md §2, "The loop's form on each backend").

On a CPU the chunk loop is a `lax.while_loop` over the live steps; off a CPU it is a
`lax.scan` over every slot, each step committed only where it is live. These tests run the
scan's form on this CPU (`FUSELOOP_DEVICE_LOOP=scan`, read when a program is traced, so
each test builds its loops afresh) and hold it to the while loop's results, bit for bit, on
MLPs (a BatchNorm model's step fuses otherwise under the scan's select and differs in the
last bits: docs/design.md §2).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_runs_identical, assert_tree_equal, make_batches, trainer
from fuseloop._fusion import chunk_slots, static_trip_count

DATA = make_batches(12)
FORM = "FUSELOOP_DEVICE_LOOP"


def _run(monkeypatch: pytest.MonkeyPatch, form: str, data=DATA, guard=False, **kwargs):
    monkeypatch.setenv(FORM, form)
    loop = trainer()
    if guard:
        loop = loop.terminate_on_nan()
    return loop.run(data, **kwargs)


def _poisoned(batches, at: int):
    x, y = batches[at]
    return [*batches[:at], (np.full_like(x, np.nan), y), *batches[at + 1 :]]


def test_the_form_follows_the_setting_and_the_backend(monkeypatch):
    monkeypatch.setenv(FORM, "scan")
    assert static_trip_count()
    assert chunk_slots(32, 4) == 4  # a short last chunk gets a program of its own size
    assert chunk_slots(32, 32) == 32
    monkeypatch.setenv(FORM, "while")
    assert not static_trip_count()
    assert chunk_slots(32, 4) == 32  # padded: the while loop stops after the live steps
    monkeypatch.delenv(FORM)
    assert static_trip_count() is (jax.default_backend() != "cpu")


@pytest.mark.parametrize("fuse", [False, 5])
def test_the_scan_trains_bitwise_as_the_while_loop(monkeypatch, fuse):
    # 12 batches in chunks of 5: two full chunks and a short one of 2 steps.
    scan = _run(monkeypatch, "scan", epochs=2, fuse=fuse)
    looped = _run(monkeypatch, "while", epochs=2, fuse=fuse)
    assert_runs_identical(scan, looped)


def test_the_scan_on_device_resident_data_with_a_short_last_chunk(monkeypatch):
    x = np.concatenate([b[0] for b in DATA])
    y = np.concatenate([b[1] for b in DATA])
    source = fl.data.arrays(x, y, batch_size=4, seed=3, device=True)
    scan = _run(monkeypatch, "scan", source, epochs=3, fuse=5)
    looped = _run(monkeypatch, "while", source, epochs=3, fuse=5)
    assert_runs_identical(scan, looped)
    assert scan.iteration == len(DATA) - 1


@pytest.mark.parametrize("fuse", [False, 5])
def test_the_scan_stops_at_a_non_finite_step_as_the_while_loop_does(monkeypatch, fuse):
    data = _poisoned(DATA, 7)
    with pytest.warns(RuntimeWarning):
        scan = _run(monkeypatch, "scan", data, guard=True, epochs=2, fuse=fuse)
    with pytest.warns(RuntimeWarning):
        looped = _run(monkeypatch, "while", data, guard=True, epochs=2, fuse=fuse)
    assert scan.status == "halted"
    assert_runs_identical(scan, looped)
    # The step state is the one before the bad step: 7 good steps, nothing of the 8th.
    clean = _run(monkeypatch, "while", DATA[:7], epochs=1, fuse=fuse)
    assert_tree_equal(scan.step_state, clean.step_state, "step_state")


def test_the_scan_in_a_whole_run_dispatch(monkeypatch):
    x = np.concatenate([b[0] for b in DATA])
    y = np.concatenate([b[1] for b in DATA])
    source = fl.data.arrays(x, y, batch_size=4, seed=1, device=True)
    scan = _run(monkeypatch, "scan", source, epochs=3, fuse="run")
    looped = _run(monkeypatch, "while", source, epochs=3, fuse=False)
    assert_runs_identical(scan, looped)


def test_the_scan_keeps_a_population_members_own_guard(monkeypatch):
    # Member 1's rate makes its loss non-finite: the guard is in the tail per member (the
    # chunk loop itself runs unguarded), so the scan must carry those flags as it steps.
    x = np.concatenate([b[0] for b in DATA])
    y = np.concatenate([b[1] for b in DATA])
    source = fl.data.arrays(x, y, batch_size=4, seed=2)
    runs = {}
    for form in ("scan", "while"):
        monkeypatch.setenv(FORM, form)
        loop = fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "sgd")
        with pytest.warns(RuntimeWarning, match=r"members \[1\]"):
            runs[form] = loop.terminate_on_nan().run(
                source, epochs=2, fuse=5, population={"learning_rate": [0.05, 1e30]}
            )
    scan, looped = runs["scan"], runs["while"]
    assert_tree_equal(scan.step_state, looped.step_state, "step_state")
    for name, value in looped.metrics.items():
        np.testing.assert_array_equal(scan.metrics[name], value)
    for i in range(2):
        assert scan.member(i).history == looped.member(i).history
        assert scan.member(i).status == looped.member(i).status
    assert scan.member(1).status == "halted"
