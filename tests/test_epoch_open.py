"""The next epoch opens before the ending one is read (EpochLoop.open_next): only where no
handler can act between the two epochs, and with everything a user sees unchanged -
params, history, events, errors, signals, one-shot consumption and threads."""

from __future__ import annotations

import functools
import os
import signal
import threading
import warnings
from typing import Any

import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, make_batches, recorder, trainer
from fuseloop.engine import carry as carry_module
from fuseloop.engine import epoch as epoch_module
from fuseloop.engine import replay as replay_module
from fuseloop.engine import run as run_module

K = 5
BATCHES = make_batches(12)  # chunks of 5, 5, 2 an epoch


@functools.cache
def _trainer() -> fl.Loop:
    """The file's one trainer: its tests add only handlers to it (sharing its compiled
    programs), so each program is traced and lowered once for the file, not per test."""
    return trainer()


@functools.cache
def _with_accuracy() -> fl.Loop:
    return _trainer().metric("accuracy")


@functools.cache
def _guarded() -> fl.Loop:
    return _trainer().terminate_on_nan()


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The epochs opened early, as `open_next` is called."""
    calls: list[int] = []
    original = epoch_module.EpochLoop.open_next

    def spy(self: Any, epoch: int, iterator: Any, bound: Any) -> None:
        calls.append(epoch)
        original(self, epoch, iterator, bound)

    monkeypatch.setattr(epoch_module.EpochLoop, "open_next", spy)
    return calls


def _never_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_module.Run, "_may_open", lambda self, epoch: False)


def _data(kind: str) -> Any:
    if kind == "resident":
        x = np.concatenate([b[0] for b in BATCHES])
        y = np.concatenate([b[1] for b in BATCHES])
        return fl.data.arrays(x, y, batch_size=4, shuffle=True, seed=3, device=True)
    return BATCHES


@pytest.mark.parametrize("kind", ["host", "resident"])
def test_the_next_epoch_opens_early_and_the_run_is_unchanged(kind, opened, monkeypatch):
    loop = _with_accuracy()
    state = loop.run(_data(kind), epochs=4, fuse=K)
    assert opened == [1, 2, 3]  # every epoch but the first opened before the last was read
    unfused = loop.run(_data(kind), epochs=4, fuse=False)
    _never_open(monkeypatch)
    closed = loop.run(_data(kind), epochs=4, fuse=K)
    assert opened == [1, 2, 3]
    for reference in (unfused, closed):
        assert_tree_equal(state.step_state, reference.step_state, "step state")
        assert state.history == reference.history
    assert state.stats["dispatches"] == closed.stats["dispatches"]
    assert state.stats["host_syncs"] == closed.stats["host_syncs"]
    assert sorted(state.times) == [0, 1, 2, 3]


def test_an_epoch_handler_keeps_every_epoch_end_synchronous(opened):
    for event in ("epoch_started", "epoch_completed", "epoch_halted"):
        _trainer().handle_event(event, lambda s: None).run(BATCHES, epochs=3, fuse=K)
    assert opened == []


def test_live_steps_do_not_open(opened):
    _trainer().run(BATCHES, epochs=3, fuse=False)
    assert opened == []


@pytest.mark.parametrize("bad_at", [None, 11, 10, 4])  # none, the epoch's last, a short chunk's
def test_a_guarded_run_opens_and_a_halt_at_the_epochs_end_rolls_the_opening_back(opened, bad_at):
    """The guard's flag is read once, at the epoch's end, after the next epoch opened:
    a non-finite step in the ending epoch undoes the opening (its first chunk ran)."""
    passes = iter(range(10))

    def data() -> Any:
        epoch = next(passes)
        if bad_at is None or epoch != 1:
            return iter(BATCHES)
        poisoned = list(BATCHES)
        poisoned[bad_at] = (np.full_like(BATCHES[bad_at][0], np.nan), BATCHES[bad_at][1])
        return iter(poisoned)

    loop = _guarded()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        state = loop.run(data, epochs=3, fuse=K)
        passes = iter(range(10))
        reference = loop.run(data, epochs=3)
    assert opened == [1, 2]  # the ending epoch opens the next, halted or not
    assert state.status == reference.status
    assert_tree_equal(state.step_state, reference.step_state, "step state")
    assert state.event_counts == reference.event_counts and state.history == reference.history
    assert state.handler_metadata.get("_nonfinite_at") == reference.handler_metadata.get(
        "_nonfinite_at"
    )


def test_iteration_handlers_see_the_opened_epochs_chunks_in_unfused_order(opened):
    log: list[Any] = []

    def loss(state: fl.State) -> float | None:
        return state.metrics.get("loss")

    def build() -> fl.Loop:
        loop = _trainer()
        for event in ("iteration_started", "iteration_completed"):
            loop = loop.handle_event(event, recorder(log, event, loss), {"every": 4})
        return loop

    fused = build().run(BATCHES, epochs=3, fuse=K)
    fused_log, log[:] = list(log), []
    unfused = build().run(BATCHES, epochs=3, fuse=False)
    assert opened == [1, 2]
    assert fused_log == log
    assert_tree_equal(fused.step_state, unfused.step_state, "step state")


class _FailsAtEpoch:
    """A re-iterable whose iterator for epoch `bad` raises at its first batch."""

    def __init__(self, batches: list[Any], bad: int):
        self.batches, self.bad, self.passes = batches, bad, 0

    def __iter__(self) -> Any:
        number, self.passes = self.passes, self.passes + 1
        if number == self.bad:
            raise_at_first = True
            yield from ()
            if raise_at_first:
                raise RuntimeError(f"pass {number} is broken")
        yield from self.batches


def test_an_error_preparing_the_opened_epoch_is_raised_after_the_epoch_before_it(opened):
    loop = _trainer()
    states = {}
    for fuse in (K, False):
        with pytest.raises(RuntimeError, match="pass 2 is broken") as info:
            loop.run(_FailsAtEpoch(BATCHES, bad=2), epochs=4, fuse=fuse)
        states[fuse] = info.value.fuseloop_state
    assert opened == [1, 2]
    fused, unfused = states[K], states[False]
    assert sorted(fused.history) == sorted(unfused.history) == [0, 1]
    assert fused.history == unfused.history
    assert_tree_equal(fused.step_state, unfused.step_state, "step state")


@pytest.mark.parametrize("where", ["open_epoch", "epoch_metrics"])
def test_a_signal_after_the_next_epoch_opened_halts_it_at_its_first_boundary(
    where, opened, monkeypatch
):
    """A signal that arrives once the next epoch is opening (or while the ending epoch is
    read) reaches the opened epoch: the ending epoch completes, the next halts after its
    first chunk, as if the signal had come during that chunk."""
    original = getattr(carry_module.Carry, where)
    sent: list[bool] = []

    def signalled(self: Any) -> Any:
        if not sent and (where == "open_epoch" or self.ended is not None):
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return original(self)

    monkeypatch.setattr(carry_module.Carry, where, signalled)
    state = _trainer().run(BATCHES, epochs=3, fuse=K)
    assert sent and opened == [1]
    assert state.status == "halted" and sorted(state.history) == [0] and state.epoch == 1
    monkeypatch.setattr(carry_module.Carry, where, original)

    def halt_after_first_chunk(s: fl.State) -> Any:
        return "halt_loop" if (s.epoch, s.iteration) == (1, K - 1) else None

    reference = (
        _trainer()
        .handle_event("iteration_completed", halt_after_first_chunk)
        .run(BATCHES, epochs=3, fuse=K)
    )
    assert reference.status == "halted" and sorted(reference.history) == [0]
    assert_tree_equal(state.step_state, reference.step_state, "step state")
    assert state.history == reference.history


def test_a_one_shot_iterator_is_consumed_exactly_and_runs_out_as_unfused(opened):
    results = {}
    for fuse in (K, False):
        source = iter(BATCHES * 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = _trainer().run(source, epochs=3, fuse=fuse)
        assert any(
            "data ran out at the start of epoch 1: the run ends after 1 epoch instead of 3"
            in str(w.message)
            for w in caught
        )
        assert next(source, None) is None
        results[fuse] = state
    assert opened == [1]  # epoch 0 took every batch: the opened epoch 1 finds none
    assert results[K].history == results[False].history
    assert_tree_equal(results[K].step_state, results[False].step_state, "step state")


def test_no_prefetch_thread_outlives_a_run_that_leaves_with_an_epoch_opened(opened, monkeypatch):
    def fail(self: Any) -> Any:
        raise RuntimeError("reading the epoch failed")

    monkeypatch.setattr(carry_module.Carry, "epoch_metrics", fail)
    before = {t for t in threading.enumerate() if t.is_alive()}
    with pytest.raises(RuntimeError, match="reading the epoch failed"):
        _trainer().run(lambda: iter(BATCHES), epochs=3, fuse=K, prefetch=2)
    assert opened == [1]
    assert {t for t in threading.enumerate() if t.is_alive()} <= before


# ------------------------------------------------------------- opened ahead of the replay
@pytest.fixture
def unfinished(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk reads as not yet finished by the device, so a replay that reads its
    records always launches ahead first (which is timing otherwise)."""
    monkeypatch.setattr(replay_module.ChunkResult, "done", lambda self: False)


def _firing_in_last_chunk(action: Any = None) -> fl.Loop:
    """A trainer whose handler fires in every epoch's last chunk (iterations 10 and 11 of
    12, chunks of 5): its replay waits, so the next epoch opens ahead of it."""

    def handler(state: fl.State) -> Any:
        return action(state) if action is not None else None

    return _trainer().handle_event("iteration_completed", handler, lambda s: s.iteration >= 10)


@pytest.mark.parametrize("kind", ["host", "resident"])
@pytest.mark.parametrize("fuse", [K, 6, 12])  # a short last chunk, or one that ends even
def test_the_next_epoch_opens_ahead_of_a_waiting_last_replay(
    kind, fuse, opened, unfinished, monkeypatch
):
    ahead: list[int] = []
    original = epoch_module.EpochLoop._open_ahead

    def spy(self: Any) -> Any:
        ahead.append(self.ahead[0])
        return original(self)

    monkeypatch.setattr(epoch_module.EpochLoop, "_open_ahead", spy)
    seen: list[Any] = []

    def record(state: fl.State) -> None:
        seen.append((state.epoch, state.iteration, state.metrics["loss"]))

    loop = _firing_in_last_chunk(record)
    state = loop.run(_data(kind), epochs=3, fuse=fuse)
    fused_seen, seen[:] = list(seen), []
    assert opened == [1, 2] and ahead == [1, 2] and len(fused_seen) == 6
    reference = loop.run(_data(kind), epochs=3, fuse=False)
    assert fused_seen == seen
    assert_tree_equal(state.step_state, reference.step_state, "step state")
    assert state.history == reference.history


@pytest.mark.parametrize("status", ["halt_loop", "halt_epoch"])
def test_a_halt_in_the_last_replay_undoes_or_keeps_the_epoch_opened_ahead(
    status, opened, unfinished, monkeypatch
):
    def halt_in_epoch_1(state: fl.State) -> Any:
        return status if state.epoch == 1 else None

    loop = _firing_in_last_chunk(halt_in_epoch_1)
    state = loop.run(BATCHES, epochs=3, fuse=K)
    # Opened ahead of each last replay: epoch 2 ahead of epoch 1's, which halted; a
    # halt_epoch keeps it (the epoch ended at that chunk anyway), a halt_loop undoes it.
    assert opened == [1, 2]
    # A fused halt takes effect at the end of its chunk: the reference is the same fused
    # run with no epoch ever opened early.
    _never_open(monkeypatch)
    reference = loop.run(BATCHES, epochs=3, fuse=K)
    assert state.status == reference.status
    assert state.epoch == reference.epoch and sorted(state.history) == sorted(reference.history)
    assert state.history == reference.history
    assert_tree_equal(state.step_state, reference.step_state, "step state")


def test_a_handler_error_in_the_last_replay_undoes_the_epoch_opened_ahead(
    opened, unfinished, monkeypatch
):
    def fail_in_epoch_1(state: fl.State) -> None:
        if state.epoch == 1:
            raise RuntimeError("handler failed")

    states = []
    for never_open in (False, True):
        if never_open:
            _never_open(monkeypatch)
        with pytest.raises(RuntimeError, match="handler failed") as info:
            _firing_in_last_chunk(fail_in_epoch_1).run(BATCHES, epochs=3, fuse=K)
        states.append(info.value.fuseloop_state)
    assert opened == [1, 2]  # opened ahead of epoch 1's last replay, then undone
    assert sorted(states[0].history) == sorted(states[1].history) == [0]
    assert_tree_equal(states[0].step_state, states[1].step_state, "step state")
    assert states[0].stats["dispatches"] == states[1].stats["dispatches"]


def test_a_one_shot_source_opens_only_after_the_replay(opened, unfinished):
    seen: list[Any] = []
    loop = _firing_in_last_chunk(lambda s: seen.append((s.epoch, s.iteration)))
    state = loop.run(iter(BATCHES), epochs=2, fuse=K)
    assert state.history and seen == [(0, 10), (0, 11)]
    assert opened == [1]  # after the replay: nothing pulled for an epoch that may not run
