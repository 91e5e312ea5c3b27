"""Chunks that copy their carry (Programs.copies, Carry.snapshot, docs/design.md §6): in a
fused run with an iteration handler, a chunk launched ahead of a replay rolls back to the
copy the chunk before it made of its own carry, with no dispatch of its own. Halts and
errors must give the run the unfused loop and the packed snapshot give."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, make_batches, trainer
from fuseloop.engine import replay as replay_module
from fuseloop.engine.carry import Carry
from fuseloop.engine.programs import Programs

DATA = make_batches(24)


@pytest.fixture
def unfinished(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk reads as not yet finished, so each replay that reads records launches
    the next chunk ahead first (which is timing otherwise)."""
    monkeypatch.setattr(replay_module.ChunkResult, "done", lambda self: False)


def _source(resident: bool) -> Any:
    if not resident:
        return DATA
    x = np.concatenate([b[0] for b in DATA])
    y = np.concatenate([b[1] for b in DATA])
    return fl.data.arrays(x, y, batch_size=len(DATA[0][0]), device=True)


def _halting_at(iteration: int, seen: list[Any]) -> fl.Loop:
    def handler(state: fl.State) -> Any:
        seen.append((state.epoch, state.iteration, state.metrics["loss"]))
        return "halt_loop" if (state.epoch, state.iteration) == (1, iteration) else None

    return trainer().handle_event("iteration_completed", handler, {"every": 5})


@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("copy_bytes", [Programs.COPY_BYTES, 0])  # 0: every carry packed
def test_a_halt_rolls_back_to_the_chunks_own_copy(unfinished, monkeypatch, resident, copy_bytes):
    monkeypatch.setattr(Programs, "COPY_BYTES", copy_bytes)
    seen: list[Any] = []
    loop = _halting_at(11, seen)  # fires at 1, 6, 11 ... of each epoch
    state = loop.run(_source(resident), epochs=3, fuse=4)  # the halt ends chunk [8..11]
    fused_seen, seen[:] = list(seen), []
    assert state.status == "halted" and int(state.step_state["step"]) == 24 + 12
    # Where the carry is copied, no snapshot was packed by a program of its own.
    assert (loop._programs.pack is None) == (copy_bytes > 0)
    if resident:
        assert {key[-1] for key in loop._programs.resident} == {True}
    else:
        assert list(loop._programs.chunk) == [True]
    # The chunk [12..15] launched ahead of that replay was dropped: the run is the unfused
    # one, halted at the same iteration.
    reference = _halting_at(11, seen).run(_source(resident), epochs=3)
    assert fused_seen == seen and seen[-1][:2] == (1, 11)
    assert_tree_equal(state.step_state, reference.step_state, "step state")
    assert state.history == reference.history


def test_an_error_in_a_replay_reports_the_carry_the_copy_holds(unfinished) -> None:
    def fail_at_10(state: fl.State) -> None:
        if state.iteration == 10:  # fires at 0, 5, 10: in chunk [8..11]
            raise RuntimeError("handler failed")

    loop = trainer().handle_event("iteration_completed", fail_at_10, {"every": 5})
    with pytest.raises(RuntimeError, match="handler failed") as caught:
        loop.run(DATA, fuse=4)
    reached = caught.value.fuseloop_state  # type: ignore[attr-defined]
    assert loop._programs.pack is None
    stepped = trainer().run(DATA, iterations=12, fuse=4)  # the chunk [8..11] ran whole
    assert_tree_equal(reached.step_state, stepped.step_state, "step state")
    assert reached.stats["dispatches"] == 3  # the chunk launched ahead was dropped


def test_only_runs_that_may_launch_ahead_compile_the_copying_chunk() -> None:
    plain = trainer()
    plain.run(DATA, fuse=4)
    guarded = plain.terminate_on_nan().handle_event("iteration_completed", lambda s: None)
    guarded.run(DATA, fuse=4)
    plain.handle_event("iteration_completed", lambda s: None).run(DATA, fuse=False)
    assert list(plain._programs.chunk) == [False]
    assert list(guarded._programs.chunk) == [False]
    handled = plain.handle_event("iteration_completed", lambda s: None, {"every": 5})
    first = handled.run(DATA, fuse=4)
    again = handled.run(DATA, epochs=2, fuse=4)
    # Adding the first iteration handler compiles the copying chunk once; then no more.
    assert first.stats["compiles"] == 1 and again.stats["compiles"] == 0
    assert sorted(plain._programs.chunk) == [False, True]
    assert again.history == plain.run(DATA, epochs=2, fuse=4).history


# ---------------------------------------------------------------------------- the carry
class _Programs:
    """What a Carry asks of its programs, counting the packs."""

    def __init__(self) -> None:
        self.packs = 0

    def pack(self, carry: Any) -> Any:
        self.packs += 1
        return ("packed", carry)

    def epoch_tail(self) -> tuple[Any, Any]:
        return {"acc": jnp.zeros(2)}, lambda: None


class _Placement:
    def put_state(self, tree: Any, made_here: bool = False) -> Any:
        return tree


class _Reads:
    def before_waiting(self, makers: Any) -> None:
        pass


def _copying_program(state: Any, tail: Any, n: Any) -> tuple[Any, ...]:
    new_state, new_tail = {"w": state["w"] + n}, {"acc": tail["acc"] + 1}
    return new_state, new_tail, "records", ("copy", new_state["w"])


def test_the_snapshot_is_the_copy_only_while_the_carry_is_the_launchs() -> None:
    programs = _Programs()
    carry = Carry(_Placement(), programs, _Reads(), {"dispatches": 0})
    carry.start({"w": jnp.zeros(3)})
    carry.reset_metrics()
    assert carry.advance(_copying_program, 1.0, copies=True) == ("records",)
    assert carry.snapshot()[0] == "copy" and programs.packs == 0
    carry.open_epoch()  # the tail is replaced: the copy no longer holds the carry
    assert carry.snapshot()[0] == "packed" and programs.packs == 1
    carry.advance(_copying_program, 1.0, copies=True)
    carry.adopt({"w": jnp.ones(3)})  # a handler's step state
    assert carry.snapshot()[0] == "packed" and programs.packs == 2
    # A program without the copy leaves nothing to take.
    carry.advance(lambda s, t, n: (s, t, "records"), 1.0)
    assert carry.snapshot()[0] == "packed" and programs.packs == 3


def test_a_carry_over_the_limit_is_not_copied() -> None:
    from fuseloop.engine.packing import copying

    program = copying(lambda state, tail: (state, tail, "records"), Programs.COPY_BYTES)
    tail = {"acc": jnp.ones(())}
    small = {"w": jnp.arange(8.0)}
    big = {"w": jnp.zeros(Programs.COPY_BYTES // 4 + 1)}  # one float over the limit
    state, new_tail, records, (buffers, whole) = program(small, tail)
    assert state is small and new_tail is tail and records == "records" and whole == []
    np.testing.assert_array_equal(np.asarray(buffers[0]), np.append(np.arange(8.0), 1.0))
    assert program(big, tail)[-1] is None
