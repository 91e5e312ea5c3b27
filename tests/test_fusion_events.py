"""Events of a fused loop: iteration events replayed once each, in
unfused order, with `step_state=None`, real counters and the metrics of their own
iteration; returned metrics/metadata kept and a returned step state discarded; halting
from iteration handlers at the end of the chunk, exactly at `fuse=1` and from
`epoch_completed`.

One Loop (with recorders on all eight events and a controllable halting/modifying handler)
serves most tests, so its programs compile once for the module."""

from __future__ import annotations

import numpy as np
import pytest

import fuseloop as fl
from conftest import (
    assert_runs_identical,
    assert_tree_equal,
    counter_init,
    counter_loop,
    make_batches,
    record_all,
    trainer,
)

DATA = make_batches(12)
LOG: list = []
CONTROL: dict = {}  # event -> ((epoch, iteration), action)


def snapshot(state: fl.State):
    return (state.step_state is None, dict(state.metrics), dict(state.event_counts))


def act(event):
    """Halts or modifies the State when `CONTROL[event]` names this (epoch, iteration)."""

    def handler(state: fl.State):
        control = CONTROL.get(event)
        if control is None or (state.epoch, state.iteration) != control[0]:
            return None
        if control[1] != "modify":
            return control[1]
        # A fused iteration handler has no step state; returning one must be ignored.
        bogus = {"bogus": np.zeros(1)} if state.step_state is None else state.step_state
        return "continue", state.replace(
            metrics={**state.metrics, "extra": 7.0},
            handler_metadata={**state.handler_metadata, "seen": [state.epoch, state.iteration]},
            step_state=bogus,
        )

    return handler


LOOP = (
    record_all(trainer(optimizer="adam").metric("accuracy"), LOG, extra=snapshot)
    .handle_event("iteration_completed", act("iteration_completed"))
    .handle_event("epoch_completed", act("epoch_completed"))
)
PLAIN = trainer(optimizer="adam").metric("accuracy")  # no handlers


def run(fuse, control=None, data=DATA, epochs=2, loop=LOOP):
    LOG.clear()
    CONTROL.clear()
    CONTROL.update(control or {})
    state = loop.run(data, epochs=epochs, fuse=fuse)
    return state, list(LOG)


@pytest.fixture(scope="module")
def unfused():
    return run(False)


def stream(log):
    return [item[:3] for item in log]


@pytest.mark.parametrize("fuse", [1, 5, 32])
def test_iteration_events_fire_once_each_in_order_with_their_own_metrics(unfused, fuse):
    reference, reference_log = unfused
    state, log = run(fuse)
    assert stream(log) == stream(reference_log)
    iteration_items = [item for item in log if item[0].startswith("iteration")]
    assert len(set(stream(iteration_items))) == len(iteration_items) == 48
    for item, expected in zip(log, reference_log, strict=True):
        event, epoch, iteration, (no_step_state, metrics, counts) = item
        # Counters and the metrics as of this iteration equal the unfused loop's.
        assert metrics == expected[3][1], (event, epoch, iteration)
        assert counts == expected[3][2], (event, epoch, iteration)
        if event.startswith("iteration"):
            assert no_step_state is True, (event, epoch, iteration)
            assert expected[3][0] is False  # unfused: the live step state
        else:
            assert no_step_state == expected[3][0], event  # epoch events: as unfused
    assert_runs_identical(reference, state)


@pytest.mark.parametrize("fuse", [False, 5])
def test_returned_metrics_and_metadata_are_kept_and_step_state_discarded(unfused, fuse):
    reference, _ = unfused
    state, log = run(fuse, {"iteration_completed": ((0, 6), "modify")})
    assert state.handler_metadata["seen"] == [0, 6]
    # The returned metric is visible to later handlers and kept in the epoch's history.
    later = [item for item in log if item[0] == "iteration_completed" and item[1:3] == (0, 7)]
    assert later[0][3][1]["extra"] == 7.0
    assert state.history[0]["extra"] == 7.0
    # Fused: the bogus step state was discarded; training is unaffected.
    assert_tree_equal(state.step_state, reference.step_state)
    assert state.history[1] == reference.history[1]  # metrics reset at the next epoch


def test_returned_values_identical_fused_and_unfused():
    control = {"iteration_completed": ((1, 2), "modify")}
    a, log_a = run(False, control)
    b, log_b = run(5, control)
    assert_runs_identical(a, b)
    assert a.handler_metadata == b.handler_metadata == {"seen": [1, 2]}
    assert [(i[:3], i[3][1]) for i in log_a] == [(i[:3], i[3][1]) for i in log_b]


@pytest.mark.parametrize("status", ["halt_epoch", "halt_loop"])
@pytest.mark.parametrize("where", [(0, 3), (1, 7)])
def test_halting_from_an_iteration_handler_at_fuse_1_is_exact(status, where):
    control = {"iteration_completed": (where, status)}
    a, log_a = run(False, control)
    b, log_b = run(1, control)
    assert_runs_identical(a, b)
    assert [(i[:3], i[3][1:]) for i in log_a] == [(i[:3], i[3][1:]) for i in log_b]
    assert b.status == ("halted" if status == "halt_loop" else "completed")


@pytest.mark.parametrize("status", ["halt_epoch", "halt_loop"])
def test_halting_at_fuse_32_takes_effect_at_the_end_of_the_chunk(status):
    control = {"iteration_completed": ((0, 3), status)}
    a, log_a = run(False, control)
    b, log_b = run(32, control)
    # The same events fire (and are counted) as in the unfused run ...
    assert b.event_counts == a.event_counts
    assert stream(log_b) == stream(log_a)
    assert b.status == a.status
    # ... but the chunk ran to its end: all 12 batches of epoch 0 were stepped.
    epochs = 2 if status == "halt_epoch" else 1
    full, _ = run(False, epochs=epochs, loop=PLAIN)
    assert_tree_equal(b.step_state, full.step_state)
    assert int(b.step_state["step"]) == 12 * epochs
    assert not np.array_equal(
        a.params["params"]["Dense_0"]["kernel"], b.params["params"]["Dense_0"]["kernel"]
    )


def test_halt_loop_mid_chunk_finishes_that_chunk_only():
    control = {"iteration_completed": ((0, 6), "halt_loop")}
    a, _ = run(False, control)
    b, _ = run(5, control)  # chunks [0..4] [5..9] [10, 11]: halts after the second
    assert b.event_counts == a.event_counts
    stepped, _ = run(False, data=DATA[:10], epochs=1, loop=PLAIN)
    assert_tree_equal(b.step_state, stepped.step_state)
    assert b.status == "halted"


@pytest.mark.parametrize("status", ["halt_loop", "halt_epoch"])
@pytest.mark.parametrize("fuse", [5, 32])
def test_halting_from_epoch_completed_is_exact(status, fuse):
    control = {"epoch_completed": ((1, 11), status)}
    a, log_a = run(False, control, epochs=3)
    b, log_b = run(fuse, control, epochs=3)
    assert_runs_identical(a, b)
    assert stream(log_a) == stream(log_b)


def test_iteration_started_sees_metrics_of_the_previous_iteration_across_chunks():
    seen: dict = {False: [], 5: []}
    loop = PLAIN.handle_event(
        "iteration_started",
        lambda s: seen[CONTROL["fuse"]].append((s.iteration, s.metrics)),
        filter=lambda s: s.iteration in (0, 5, 10),
    )
    loop_once = PLAIN.handle_event(
        "iteration_started",
        lambda s: seen[CONTROL["fuse"]].append((s.iteration, s.metrics)),
        filter={"once": 6},
    )
    for fuse in (False, 5):
        CONTROL.clear()
        CONTROL["fuse"] = fuse
        loop.run(DATA, fuse=fuse)
        loop_once.run(DATA, fuse=fuse)
    assert seen[5] == seen[False]
    assert [i for i, _ in seen[5]] == [0, 5, 10, 5]
    assert seen[5][0][1] == {}  # nothing has run yet in the epoch
    # (the trainer's named optimizer makes learning_rate a default metric)
    assert set(seen[5][1][1]) == {"loss", "learning_rate", "accuracy"}


@pytest.mark.parametrize("fuse", [4, 5])
def test_epoch_handlers_see_the_same_counts_without_iteration_handlers(fuse):
    def collect(bucket):
        return lambda s: bucket.append((s.epoch, dict(s.event_counts), dict(s.metrics)))

    a: list = []
    b: list = []
    counter_loop().handle_event("epoch_completed", collect(a)).run(DATA, counter_init(), epochs=3)
    counter_loop().handle_event("epoch_completed", collect(b)).run(
        DATA, counter_init(), epochs=3, fuse=fuse
    )
    assert a == b
    assert a[-1][1]["iteration_completed"] == {"total": 36, "epoch": 12}


# --------------------------------------------------------------------------- launch ahead
# Whether the epoch loop launches the next chunk before a replay that reads records depends
# on whether the device has finished the chunk (`ChunkResult.done`), which is timing. Both
# ways must give the same run; these tests pin each way.
@pytest.fixture(params=["always", "never"])
def launch_ahead(request, monkeypatch):
    from fuseloop.engine import carry, replay

    snapshots: list = []
    original = carry.Carry.snapshot

    def counted(self):
        snapshots.append(1)
        return original(self)

    monkeypatch.setattr(carry.Carry, "snapshot", counted)
    finished = request.param == "never"  # a finished chunk is never launched ahead of
    monkeypatch.setattr(replay.ChunkResult, "done", lambda self: finished)
    return request.param, snapshots


@pytest.mark.parametrize("status", ["halt_loop", "halt_epoch"])
@pytest.mark.parametrize("resident", [False, True])
def test_launching_ahead_or_not_gives_the_same_halted_run(launch_ahead, status, resident):
    mode, snapshots = launch_ahead
    x = np.concatenate([b[0] for b in DATA])
    y = np.concatenate([b[1] for b in DATA])
    data = fl.data.arrays(x, y, batch_size=len(DATA[0][0]), device=True) if resident else DATA
    control = {"iteration_completed": ((0, 6), status)}
    a, log_a = run(False, control, data=data)
    b, log_b = run(5, control, data=data)  # chunks [0..4] [5..9] [10, 11]
    assert b.event_counts == a.event_counts
    assert stream(log_b) == stream(log_a)
    assert b.status == a.status
    # The halt takes effect at the end of the chunk it came from: 10 steps in epoch 0.
    steps = 10 if status == "halt_loop" else 22
    assert int(b.step_state["step"]) == steps
    # A chunk launched ahead and dropped does not count as a dispatch.
    assert b.stats["dispatches"] == (2 if status == "halt_loop" else 5)
    assert (len(snapshots) > 0) == (mode == "always")


def test_launching_ahead_or_not_gives_the_same_run(launch_ahead):
    mode, snapshots = launch_ahead
    reference, reference_log = run(False)
    state, log = run(5)
    assert stream(log) == stream(reference_log)
    assert [i[3][1] for i in log] == [i[3][1] for i in reference_log]
    assert_runs_identical(reference, state)
    assert (len(snapshots) > 0) == (mode == "always")


@pytest.mark.parametrize("resident", [False, True])
def test_a_halt_among_sparse_firings_stops_at_the_end_of_its_chunk(launch_ahead, resident):
    """A handler firing every 10 iterations halts in the chunk [9, 10, 11]: the chunk
    launched ahead of its replay is dropped, and the run is the one that stopped there."""
    mode, snapshots = launch_ahead
    data = make_batches(24)
    x = np.concatenate([b[0] for b in data])
    y = np.concatenate([b[1] for b in data])
    source = fl.data.arrays(x, y, batch_size=len(data[0][0]), device=True) if resident else data
    seen: list = []

    def halt_at_10(state: fl.State):
        seen.append((state.iteration, state.metrics["loss"]))
        return "halt_loop" if state.iteration == 10 else None

    loop = PLAIN.handle_event("iteration_completed", halt_at_10, {"every": 10})
    unfused = loop.run(source, epochs=2)
    unfused_seen, seen[:] = list(seen), []
    fused = loop.run(source, epochs=2, fuse=3)  # chunks of 3: the halt is in [9, 10, 11]
    assert seen == unfused_seen == [(0, seen[0][1]), (10, seen[1][1])]
    assert fused.event_counts == unfused.event_counts
    assert fused.status == "halted" and int(fused.step_state["step"]) == 12
    assert fused.stats["dispatches"] == 4
    stepped = PLAIN.run(source, epochs=1, iterations=12, fuse=3)
    assert_tree_equal(fused.step_state, stepped.step_state)
    assert (len(snapshots) > 0) == (mode == "always")


def test_an_error_in_a_replayed_chunk_reports_the_carry_at_its_end(launch_ahead):
    def fail_at_10(state: fl.State):
        if state.iteration == 10:
            raise RuntimeError("handler failed")

    loop = PLAIN.handle_event("iteration_completed", fail_at_10, {"every": 10})
    with pytest.raises(RuntimeError, match="handler failed") as caught:
        loop.run(make_batches(24), epochs=2, fuse=3)
    reached = caught.value.fuseloop_state  # type: ignore[attr-defined]
    assert reached.iteration == 10 and reached.epoch == 0
    assert int(reached.step_state["step"]) == 12  # the chunk [9, 10, 11] ran, no later one
    assert reached.stats["dispatches"] == 4
