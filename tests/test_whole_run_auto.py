"""`fuse="auto"` on device-resident data (docs/design.md §9): the cost model's K, when it
exceeds the epoch, becomes whole epochs per dispatch; exactness is that of any whole run.
The probe's timings are fixed here so the choice does not depend on the machine.
"""

from __future__ import annotations

import pytest

from fuseloop.engine import auto_chunk
from test_whole_run import (
    BATCHES,
    _assert_same_run,
    _data,
    _recorder,
    _trainer,
    _validated,
    _xy,
)

STEP_S = 1e-4


def _timed(monkeypatch: pytest.MonkeyPatch, wanted: int) -> None:
    """The probe measures a dispatch overhead worth `wanted` steps at 2% tolerance."""
    overhead = wanted * auto_chunk.DEFAULT_TOLERANCE * STEP_S
    monkeypatch.setattr(auto_chunk, "_timings", lambda *args: (STEP_S, overhead))


@pytest.mark.parametrize(("wanted", "dispatches"), [(1000, 1), (2 * BATCHES, 3), (BATCHES, 5)])
def test_auto_crosses_epochs_when_the_cost_model_asks(monkeypatch, wanted, dispatches):
    _timed(monkeypatch, wanted)
    plain_events, fused_events = [], []
    plain = _recorder(plain_events).run(_data(), epochs=5, fuse=False)
    loop = _recorder(fused_events)
    fused = loop.run(_data(), epochs=5, fuse="auto")
    _assert_same_run(fused, plain)
    assert fused_events == plain_events
    assert fused.stats["dispatches"] == dispatches
    if wanted > BATCHES:
        assert fused.stats["whole_run"] == "many epochs per dispatch"
        assert fused.stats["dispatch_splits"] == {}
    else:  # one epoch's chunk is enough: the per-epoch engine
        assert "cost model" in fused.stats["whole_run"]
    again = loop.run(_data(), epochs=5, fuse="auto")
    assert again.stats["compiles"] == 0


def test_auto_runs_validation_and_early_stop_on_the_device(monkeypatch):
    _timed(monkeypatch, 1000)
    plain = _validated(patience=2).run(_data(), epochs=25, fuse=False)
    fused = _validated(patience=2).run(_data(), epochs=25, fuse="auto")
    _assert_same_run(fused, plain)
    assert fused.stats["dispatches"] == 1


def test_auto_keeps_epoch_bounded_chunks_on_host_data(monkeypatch):
    _timed(monkeypatch, 1000)
    xs, ys = _xy()
    batches = [(xs[i : i + 16], ys[i : i + 16]) for i in range(0, 96, 16)]
    state = _trainer().run(batches, epochs=2, fuse="auto")
    assert state.stats["dispatches"] == 2


def test_auto_says_why_it_stays_within_the_epoch_when_nothing_was_timed(monkeypatch):
    """A step with side effects is not timed (K is fuse=True's); the stat said the cost
    model had chosen."""
    monkeypatch.setattr(auto_chunk, "_timings", lambda *args: None)
    state = _trainer().run(_data(), epochs=2, fuse="auto")
    assert state.stats["whole_run"] == (
        "fuse='auto': one epoch or less per dispatch (not timed: the step has side effects)"
    )
    assert state.stats["dispatches"] == 2
