"""Diagnostics: what a loop costs per epoch, and the automatic chunk size (`fuse="auto"`).

`report(loop, data, fuse=32)` runs the loop fused and unfused and says, in a few lines,
how often it dispatches, synchronizes and transfers per epoch, what XLA fused, and how much
of each iteration is dispatch overhead rather than compute.

`decide_chunk_size` / `choose_chunk_size` expose `run(fuse="auto")`'s cost model
(`fuseloop.engine.auto_chunk`): enough steps per dispatch that the dispatch overhead stays
below a tolerance of the step time, capped by a memory budget, `max_chunk`, the epoch.

Example:
    >>> import fuseloop as fl, numpy as np, optax
    >>> loop = fl.trainer(fl.models.mlp([8, 2]), "sparse_categorical_cross_entropy",
    ...                   optax.sgd(0.1))
    >>> data = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))] * 8
    >>> print(fl.diagnostics.report(loop, data, fuse=4, reps=1))
    fuseloop diagnostics: 8 iterations/epoch, fuse=4 vs fuse=False
      dispatches/epoch   2 (unfused 8);  host syncs/epoch 1 (unfused 1)
    ...
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ._batch_sequence import is_batch_sequence
from ._hlo import count_fusions
from ._loop import Loop
from ._state import State
from ._step import init_tail
from .engine import auto_chunk
from .engine.auto_chunk import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_MAX_CHUNK,
    DEFAULT_TOLERANCE,
    ChunkDecision,
)
from .engine.programs import Programs

__all__ = [
    "explain_dispatches",
    "Report",
    "ChunkDecision",
    "report",
    "choose_chunk_size",
    "decide_chunk_size",
    "count_fusions",
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_MAX_CHUNK",
    "DEFAULT_TOLERANCE",
]


# --------------------------------------------------------------------------- fuse="auto"
def decide_chunk_size(
    loop: Any,
    step_state: Any,
    first_batch: Any,
    *,
    placement: Any = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    tolerance: float = DEFAULT_TOLERANCE,
    epoch_length: int | None = None,
) -> ChunkDecision:
    """What `run(fuse="auto")` would choose for `loop`, and why: a `ChunkDecision`.

    The step and dispatch times are measured once per loop, batch shape and mesh (kept in
    the loop's program cache); nothing else about the loop changes.

    Args:
        loop: The Loop being run.
        step_state: The initial step state (only read, never donated), None for the
            loop's own fresh one; an evaluator's: the variables (or State) its run takes.
        first_batch: A batch (no data is consumed).
        placement: The run's mesh (a jax.sharding.Mesh, as run(mesh=) takes), or None.
        budget_bytes: Memory budget for one stacked chunk.
        max_chunk: Upper bound on K.
        tolerance: Acceptable dispatch overhead as a fraction of the step time.
        epoch_length: Batches per epoch, when known: caps K and balances the chunks.

    Returns:
        The decision: `chunk_size`, the measured `step_us` and `overhead_us`, and which
        `bound` decided.

    Example:
        >>> step_state = loop.run(batches).step_state
        >>> decision = decide_chunk_size(loop, step_state, batches[0], epoch_length=4)
        >>> decision.chunk_size, decision.bound  # a 4-batch epoch caps K (timings vary)
        (4, 'epoch length')
    """
    auto_chunk.require(loop, Loop, "loop", "fl.trainer(...)")
    programs, step_state = auto_chunk.checked_programs(loop, step_state, first_batch)
    return auto_chunk.decide_chunk_size(
        programs,
        step_state,
        first_batch,
        placement=auto_chunk.as_placement(placement),
        budget_bytes=budget_bytes,
        max_chunk=max_chunk,
        tolerance=tolerance,
        epoch_length=epoch_length,
    )


def choose_chunk_size(
    loop: Any,
    step_state: Any,
    first_batch: Any,
    *,
    placement: Any = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    tolerance: float = DEFAULT_TOLERANCE,
    epoch_length: int | None = None,
) -> int:
    """The chunk size K `run(fuse="auto")` uses (see `decide_chunk_size`).

    Example:
        >>> step_state = loop.run(batches).step_state
        >>> choose_chunk_size(loop, step_state, batches[0], max_chunk=2)
        2
    """
    return decide_chunk_size(
        loop,
        step_state,
        first_batch,
        placement=placement,
        budget_bytes=budget_bytes,
        max_chunk=max_chunk,
        tolerance=tolerance,
        epoch_length=epoch_length,
    ).chunk_size


# --------------------------------------------------------------------------- report
@dataclass(frozen=True)
class Report:
    """Per-epoch costs of a loop, fused and unfused (`str(report)` is the readable form).

    Attributes:
        chunk_size: K of the fused run.
        iterations: Steps per epoch.
        fused: Counters of one fused epoch: dispatches, host_syncs, h2d_transfers, h2d_bytes,
            compiles (0 for a loop that ran before), us_per_iteration; resident: dataset_bytes,
            its one transfer (a fresh source's first batch read is one more host sync).
        unfused: The same for `fuse=False`.
        step_fusions: XLA fusions in the compiled single step.
        chunk_fusions: XLA fusions in the compiled fused chunk program.
        step_us: Measured device time of one step.
        dispatch_overhead_us: Measured fixed cost of one dispatch.
        auto: The `fuse="auto"` decision, when `fuse="auto"` was reported.

    Example:
        >>> found = fl.diagnostics.report(loop, batches, fuse=4, reps=1)
        >>> found.unfused["dispatches"], found.fused["dispatches"], found.auto is None
        (4, 1, True)
    """

    chunk_size: int
    iterations: int
    fused: dict[str, float]
    unfused: dict[str, float]
    step_fusions: int
    chunk_fusions: int
    step_us: float
    dispatch_overhead_us: float
    auto: ChunkDecision | None = None

    def __str__(self) -> str:
        f, u = self.fused, self.unfused
        speedup = u["us_per_iteration"] / max(f["us_per_iteration"], 1e-9)
        lines = [
            f"fuseloop diagnostics: {self.iterations} iterations/epoch, "
            f"fuse={self.chunk_size} vs fuse=False"
            + (f" (auto: {self.auto.bound} bound)" if self.auto else ""),
            f"  dispatches/epoch   {f['dispatches']:g} (unfused {u['dispatches']:g});"
            f"  host syncs/epoch {f['host_syncs']:g} (unfused {u['host_syncs']:g})",
            f"  host->device/epoch {f['h2d_transfers']:g} transfers, {_kib(f['h2d_bytes'])}"
            f" (unfused {u['h2d_transfers']:g}, {_kib(u['h2d_bytes'])}"
            + (
                f"; the resident dataset, {_kib(f['dataset_bytes'])}, moves once)"
                if "dataset_bytes" in f
                else ")"
            ),
            f"  compiles           {f['compiles']:g} fused, {u['compiles']:g} unfused"
            f" (first run; later runs reuse them)",
            f"  XLA fusions        step {self.step_fusions}, fused chunk {self.chunk_fusions}",
            f"  time/iteration     unfused {u['us_per_iteration']:.1f} us, fused "
            f"{f['us_per_iteration']:.1f} us ({speedup:.1f}x); step compute "
            f"{self.step_us:.1f} us",
            f"  dispatch overhead  {self.dispatch_overhead_us:.1f} us/dispatch: "
            f"{u['us_per_iteration'] - self.step_us:.1f} us/iter unfused, "
            f"{f['us_per_iteration'] - self.step_us:.1f} us/iter fused "
            f"(time/iteration - step compute)",
        ]
        return "\n".join(lines)


def _epoch_seconds(state: Any) -> float:
    return float(sum(state.stats["epoch_time"].values()))


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def _counters(state: Any, transfer_bytes: int) -> dict[str, float]:
    stats = state.stats
    return {
        "dispatches": stats["dispatches"],
        "host_syncs": stats["host_syncs"],
        "h2d_transfers": stats["h2d_transfers"],
        "h2d_bytes": stats["h2d_transfers"] * transfer_bytes,
        "compiles": stats["compiles"],
    }


def _program_fusions(
    loop: Any, step_state: Any, batch: Any, chunk_size: int
) -> tuple[int, int, Any]:
    """XLA fusions of the run's unfused-step and chunk programs, and the chunk program.

    They are the loop's cached programs, already compiled by the runs the report made, so
    lowering them again compiles nothing new.
    """
    programs = Programs(loop)
    with jax.transfer_guard("allow"):  # the library's own accumulators, not the caller's data
        tail = init_tail(loop.metrics, loop.guard_nonfinite)
    one = np.int32(1)
    step_text = programs.unfused().lower(step_state, tail, batch, one).compile().as_text()
    chunk = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((chunk_size,) + np.shape(a), np.asarray(a).dtype), batch
    )
    chunk_program = programs.chunk()
    chunk_text = chunk_program.lower(step_state, tail, chunk, one).compile().as_text()
    return count_fusions(step_text), count_fusions(chunk_text), chunk_program


def report(
    loop: Any,
    data: Any,
    fuse: Any = 32,
    *,
    init_state: Any = None,
    reps: int = 3,
    iterations: int | None = None,
) -> Report:
    """Runs one epoch of `loop` fused and unfused and reports what each costs.

    Beside `reps` timed epochs of each: dispatches, syncs, transfers, compiles, fusions.

    The loop runs as built, handlers included. `data` must be re-iterable (a list, an
    `fl.data.arrays` source) or a callable returning an iterator: each run starts a fresh
    pass.

    Args:
        loop: The Loop to diagnose.
        data: Re-iterable data, or a callable returning an iterator.
        fuse: The chunk size to report (a positive int, True for 32, or "auto").
        init_state: Passed to `run` (an evaluator needs its params); a State runs on.
        reps: Timed epochs of each kind; the median is reported.
        iterations: Bound on iterations per epoch.

    Returns:
        A `Report`; `print(report)` shows it in a few lines.

    Example:
        >>> found = fl.diagnostics.report(loop, batches, fuse=2, reps=1)
        >>> found.chunk_size, found.iterations, found.fused["dispatches"]
        (2, 4, 2)
    """
    _check_report_arguments(loop, data, fuse, reps)
    resumes = isinstance(init_state, State) and loop.program.kind != "evaluator"
    epochs = max(init_state.history, default=-1) + 2 if resumes else 1  # one more than it ran

    def run(k: Any) -> Any:
        return loop.run(data, init_state, fuse=k, iterations=iterations, epochs=epochs)

    first_fused, first_unfused = run(fuse), run(False)
    n_iter = max(first_unfused.stats["dispatches"], 1)  # one dispatch per step unfused
    seconds = _interleaved_epochs(run, fuse, reps)
    batch = data[0] if is_batch_sequence(data) else next(iter(data() if callable(data) else data))
    k = int(first_fused.stats["chunk_size"])
    fused, unfused = _epoch_counters(first_fused, first_unfused, data, batch, k)
    fused["us_per_iteration"] = statistics.median(seconds["fused"]) / n_iter * 1e6
    unfused["us_per_iteration"] = statistics.median(seconds["unfused"]) / n_iter * 1e6
    step_state = first_fused.step_state
    step_fusions, chunk_fusions, chunk = _program_fusions(loop, step_state, batch, k)
    step_s, overhead_s = _probe(loop, step_state, batch, k, chunk)
    auto = _auto_decision(loop, first_fused, batch, data, iterations) if fuse == "auto" else None
    return Report(
        k, n_iter, fused, unfused, step_fusions, chunk_fusions, step_s * 1e6, overhead_s * 1e6, auto
    )


def _check_report_arguments(loop: Any, data: Any, fuse: Any, reps: Any) -> None:
    auto_chunk.require(loop, Loop, "loop", "fl.trainer(...)")
    auto_chunk.check_positive(reps, "reps")
    if fuse is False or fuse is None:
        raise ValueError(
            "fuse=False: report compares a fused run with the unfused one; pass "
            "fuse=<chunk size>, True or 'auto'"
        )
    if callable(data) or is_batch_sequence(data):
        return  # a fresh iterator per epoch, as `run` takes it
    if not hasattr(data, "__iter__") or iter(data) is data:
        what = "a one-shot iterator" if hasattr(data, "__iter__") else type(data).__name__
        raise ValueError(
            "data: report runs several epochs, so it needs re-iterable data (a list of "
            f"batches, fl.data.arrays(...) or a callable returning an iterator), not {what}"
        )


def _interleaved_epochs(run: Callable[[Any], Any], fuse: Any, reps: int) -> dict[str, list[float]]:
    """Epoch times of `reps` unfused and fused runs, in turn (both see the same load)."""
    times: dict[str, list[float]] = {"fused": [], "unfused": []}
    for _ in range(reps):
        times["unfused"].append(_epoch_seconds(run(False)))
        times["fused"].append(_epoch_seconds(run(fuse)))
    return times


def _epoch_counters(
    fused_state: Any, unfused_state: Any, data: Any, batch: Any, k: int
) -> tuple[dict[str, float], dict[str, float]]:
    """The fused and the unfused run's counters per epoch, with the bytes they moved."""
    batch_bytes = auto_chunk.nbytes(batch)
    fused = _counters(fused_state, k * batch_bytes)  # (its count is a device scalar)
    unfused = _counters(unfused_state, batch_bytes)
    if getattr(data, "resident", False):
        # A device-resident source moves the dataset once, in whichever run first used it
        # (the fused one, run first, on a fresh source): no epoch moves anything.
        for counters in (fused, unfused):
            counters.update(
                h2d_transfers=0, h2d_bytes=0, dataset_bytes=auto_chunk.nbytes((data.x, data.y))
            )
    return fused, unfused


def _probe(loop: Any, step_state: Any, batch: Any, k: int, chunk: Any) -> tuple[float, float]:
    """Seconds per step and per dispatch, measured as `fuse="auto"` measures them."""
    # The probe reuses the run's chunk program (K slots), so it compiles nothing new.
    programs = Programs(loop)
    copies, program = (k, chunk) if k > 1 else (auto_chunk.PROBE_COPIES, None)
    timings = auto_chunk.probe(programs, step_state, batch, None, copies, program, True)
    assert timings is not None  # timed whatever the step does
    return timings


def _auto_decision(
    loop: Any, state: State, batch: Any, data: Any, iterations: int | None
) -> ChunkDecision:
    """What `fuse="auto"` decides (an evaluator from its params), the epoch capped as in a run."""
    length = None
    with contextlib.suppress(TypeError):  # a source of unknown length raises from len()
        length = len(data) if hasattr(data, "__len__") else None
    known = [n for n in (iterations, length) if n]
    given = state.params if loop.program.kind == "evaluator" else state.step_state
    return decide_chunk_size(loop, given, batch, epoch_length=min(known) if known else None)


def explain_dispatches(state: Any) -> str:
    """Says how a run was dispatched, and where and why a dispatch ended early.

    How many dispatches, whether they crossed epochs (`run(fuse="run")` or a chunk larger
    than the epoch on device-resident data), and at which epochs a dispatch ended before
    it had to and why (docs/design.md §9).

    Args:
        state: The State a run returned.

    Returns:
        A few lines of text.

    Example:
        >>> import fuseloop as fl, numpy as np, optax
        >>> data = fl.data.arrays(np.ones((8, 3), np.float32), np.zeros(8, np.int32),
        ...                       batch_size=4, device=True)
        >>> loop = fl.trainer(fl.models.mlp([4, 2]), "sparse_categorical_cross_entropy",
        ...                   optax.sgd(0.1))
        >>> state = loop.handle_event("epoch_completed", lambda s: None, filter={"once": 2})
        >>> print(explain_dispatches(state.run(data, epochs=3, fuse="run")))
        2 dispatches; many epochs per dispatch
          a dispatch ended after epoch 1: <lambda> on epoch_completed sees the live State
    """
    auto_chunk.require(state, State, "state", "the State a run returned")
    stats = state.stats
    crossing = stats.get("whole_run", "one epoch or less per dispatch")
    lines = [f"{stats['dispatches']} dispatches; {crossing}"]
    for epoch, reason in sorted(stats.get("dispatch_splits", {}).items()):
        lines.append(f"  a dispatch ended after epoch {epoch}: {reason}")
    return "\n".join(lines)
