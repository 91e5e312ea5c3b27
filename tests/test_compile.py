"""Compilation: a second run of a Loop does not recompile, one program serves every chunk
of every epoch (padded last chunk included), and the fused program does not grow with K
(the device loop is a `while_loop`, not an unrolled Python loop).

`stats["compiles"]` is cross-checked against JAX's own compile log."""

from __future__ import annotations

import contextlib
import logging
import re

import jax
import numpy as np
import pytest

import fuseloop as fl
from conftest import counter_init, counter_loop, make_batches, tiny_mlp, trainer

DATA = make_batches(12)


@contextlib.contextmanager
def jax_compiles():
    """Collects the names of the programs XLA compiles inside the block."""
    names: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = re.match(r"Compiling (\S+)", record.getMessage())
            if match:
                names.append(match.group(1))

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger("jax")
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        yield names
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


@pytest.mark.parametrize("fuse", [False, 5, 32])
def test_second_run_does_not_recompile(fuse):
    loop = trainer().metric("accuracy")
    first = loop.run(DATA, epochs=3, fuse=fuse)
    # One program for all epochs and, fused, for the padded last chunk (12 = 5 + 5 + 2).
    assert first.stats["compiles"] == 1
    with jax_compiles() as compiled:
        second = loop.run(DATA, epochs=2, fuse=fuse)
        third = loop.run(make_batches(12, seed=9), epochs=1, iterations=7, fuse=fuse)
    assert second.stats["compiles"] == 0 and third.stats["compiles"] == 0
    assert compiled == []


def test_fused_loop_with_iteration_handlers_compiles_once():
    loop = (
        trainer()
        .metric("accuracy")
        .handle_event("iteration_completed", lambda s: None, {"every": 4})
    )
    first = loop.run(DATA, epochs=2, fuse=5)
    assert first.stats["compiles"] == 1
    with jax_compiles() as compiled:
        second = loop.run(DATA, epochs=2, fuse=5, iterations=11)
    assert second.stats["compiles"] == 0 and compiled == []


def test_evaluator_and_custom_loop_do_not_recompile():
    params = tiny_mlp().init(jax.random.PRNGKey(0), DATA[0][0])
    evaluator = fl.evaluator(tiny_mlp()).metric("accuracy")
    custom = counter_loop()
    for fuse in (False, 4):
        evaluator.run(DATA, params, fuse=fuse)
        custom.run(DATA, counter_init(), fuse=fuse)
        with jax_compiles() as compiled:
            assert evaluator.run(DATA, params, epochs=2, fuse=fuse).stats["compiles"] == 0
            assert custom.run(DATA, counter_init(), fuse=fuse).stats["compiles"] == 0
        assert compiled == []


def test_a_validation_attached_again_compiles_nothing_and_a_run_counts_its_compiles():
    # A sweep rebuilds `base.validate(model, val).early_stop(...)` for each setting: the
    # evaluator built for the same model and metrics the first time is taken again.
    model, val = tiny_mlp(), make_batches(3, seed=5)
    base = trainer().metric("accuracy")
    base.run(DATA, epochs=1)  # the trainer's own programs
    first = base.validate(model, val).early_stop("validation_loss", patience=2).run(DATA)
    assert first.stats["compiles"] == 1  # the evaluator's program, counted by its run
    with jax_compiles() as compiled:
        for patience in (3, 4):
            swept = base.validate(model, val).early_stop("validation_loss", patience=patience)
            assert swept.run(DATA).stats["compiles"] == 0
    assert compiled == []
    # Another model object is another evaluator, compiled anew and counted.
    other = base.validate(tiny_mlp(), val).run(DATA)
    assert other.stats["compiles"] == 1 and other.metrics == first.metrics
    # A metric added after validate makes a new trainer program and keeps the evaluator:
    # both count.
    hits = lambda y, p: (p.argmax(-1) == y).astype(np.float32)  # noqa: E731
    later = base.validate(tiny_mlp(), val).metric(hits, name="hits").run(DATA)
    assert later.stats["compiles"] == 2

    class KeepsItsLoop:  # a user's handler holding its own Loop: not an evaluator
        def __call__(self, state):
            return None

    holder, fresh = KeepsItsLoop(), trainer()
    holder.loop = fresh  # shares the run's program cache: it was counted twice
    assert fresh.handle_event("epoch_completed", holder).run(DATA).stats["compiles"] == 1


def test_a_first_auto_run_counts_the_chunk_program_its_probe_compiled():
    # The probe times a chunk before the first epoch, compiling it then: the count once
    # began after it, so a first fuse="auto" run reported 0 compiles.
    loop, data = trainer(), DATA[:8]  # the probe's chunk holds 8: the epoch caps K there
    first = loop.run(data, epochs=2, fuse="auto")
    # One program where the size chosen is the probe's, else that one too.
    assert first.stats["compiles"] == (1 if first.stats["chunk_size"] == 8 else 2)
    assert loop.run(data, epochs=2, fuse="auto").stats["compiles"] == 0


def test_compile_counter_sees_a_new_shape():
    """Control: the counter does count compiles (a new batch size is a new program)."""
    loop = counter_loop()
    loop.run(DATA[:2], counter_init())
    with jax_compiles() as compiled:
        state = loop.run(make_batches(2, batch=8), counter_init())
    assert state.stats["compiles"] == 1
    assert compiled


def test_a_new_loop_over_the_same_data_compiles_only_its_model_programs():
    """The programs that depend on the data alone (a resident source's epoch order and
    first batch, zeroed accumulators; the carry's pack and unpack too) are shared by every
    Loop of the process: a new trainer over the same data (a sweep) compiles its own
    model's programs only. (A size, batch size and metric name no other test uses: the
    first Loop compiles the shared programs here.)"""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(43, 4)).astype(np.float32)
    data = fl.data.arrays(x, rng.integers(0, 3, 43).astype(np.int32), batch_size=7, device=True)

    def sweep_hits(y_true, y_pred):
        return (y_pred.argmax(-1) == y_true).astype(np.float32)

    compiled = []
    for width in (5, 6):
        loop = fl.trainer(fl.models.mlp([width, 3]), "sparse_categorical_cross_entropy", "sgd")
        with jax_compiles() as names:
            state = loop.metric(sweep_hits).run(data, epochs=2, fuse=3)
        assert state.status == "completed" and state.stats["compiles"] == 1
        compiled.append(set(names))
    shared = {"jit(next_epoch)", "jit(first)", "jit(<lambda>)"}  # the last: zeroed sums
    assert shared <= compiled[0]  # the first Loop compiled them ...
    assert not shared & compiled[1], compiled[1]  # ... and the second reused them
    assert "jit(fuseloop_program)" in compiled[1]  # its own model's steps


# --------------------------------------------------------------------------- program size
def _fused_program_text(k: int) -> tuple[str, str]:
    """The lowered (StableHLO) and compiled (optimized HLO) text of the trainer's fused
    program for chunks of `k` batches, recording per-iteration metrics."""
    from fuseloop._fusion import make_chunk_fn
    from fuseloop._step import init_tail, make_carry_step

    loop = trainer().metric("accuracy")
    program = loop.program
    state = program.init(DATA[0], None)
    tail = init_tail(loop.metrics, False)
    chunk = jax.tree.map(lambda a: np.zeros((k,) + a.shape, a.dtype), DATA[0])
    fn = make_chunk_fn(make_carry_step(program, loop.metrics, False), True, False)
    lowered = jax.jit(fn).lower(state, tail, chunk, np.int32(k))
    return lowered.as_text(), lowered.compile().as_text()


def _ops(text: str) -> int:
    return sum(1 for line in text.splitlines() if "=" in line)


def test_fused_program_does_not_grow_with_chunk_size():
    small_lowered, small_compiled = _fused_program_text(8)
    large_lowered, large_compiled = _fused_program_text(256)
    assert _ops(large_lowered) == _ops(small_lowered)
    assert _ops(large_compiled) <= 1.1 * _ops(small_compiled)
    assert len(large_compiled) <= 1.1 * len(small_compiled)
    # The steps run in a device-side loop.
    assert re.search(r"\bwhile\(", large_compiled)


@pytest.mark.parametrize("fuse", [False, 4])
def test_another_iterations_bound_on_device_data_does_not_recompile(fuse):
    """`iterations=` ends a resident epoch early through a runtime value of the program
    (it was a compile-time constant: each new bound compiled the program again)."""
    x, y = (np.concatenate(parts) for parts in zip(*make_batches(), strict=True))
    data = fl.data.arrays(x, y, batch_size=4, device=True)
    loop = trainer()
    assert loop.run(data, iterations=10, fuse=fuse).stats["compiles"] == 1
    with jax_compiles() as compiled:
        for bound in (10, 7, None):
            state = loop.run(data, iterations=bound, fuse=fuse)
            assert state.stats["compiles"] == 0 and state.iteration == (bound or 12) - 1
    assert compiled == []


@pytest.mark.parametrize("fuse", [False, 5])
def test_epoch_handlers_read_the_compiles_so_far(fuse):
    # `stats["compiles"]` is brought up to date at each epoch's end, not only the run's.
    seen: list[int] = []
    loop = trainer().handle_event("epoch_completed", lambda s: seen.append(s.stats["compiles"]))
    loop.run(DATA, epochs=2, fuse=fuse)
    loop.run(DATA, epochs=2, fuse=fuse)
    assert seen == [1, 1, 0, 0]
    # A validation before it counts its evaluator's compiles of that epoch.
    seen.clear()
    checked = (
        trainer()
        .validate(tiny_mlp(), DATA[:3])
        .handle_event("epoch_completed", lambda s: seen.append(s.stats["compiles"]))
    )
    final = checked.run(DATA, epochs=2, fuse=fuse).stats["compiles"]
    assert seen == [final, final] and final > 1
