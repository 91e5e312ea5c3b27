"""Diagnostics: what a loop costs per epoch, and the automatic chunk size (`fuse="auto"`).

`report(loop, data, fuse=32)` runs the loop fused and unfused and says, in a few lines,
how often it dispatches, synchronizes and transfers per epoch, what XLA fused, and how much
of each iteration is dispatch overhead rather than compute.

`choose_chunk_size` is the cost model behind `run(fuse="auto")`. A fused chunk of K steps
costs about `overhead + K * step`, where `overhead` is the fixed price of one dispatch (the
call, the chunk's transfer latency, the wait) and `step` the device time of one step. Per
iteration that is `step * (1 + overhead / (K * step))`, so K is the smallest power of two
with `overhead / (K * step) <= tolerance` (2% by default), then capped:

  * by the memory budget: `K * bytes(batch) <= budget_bytes` (64 MiB by default) - the
    stacked chunk never exceeds it;
  * by `max_chunk` (1024) and, when known, by the epoch length, whose chunks are then
    balanced (100 batches with K=64 run as two chunks of 50, not 64 + 36 padded slots).

Both figures are measured once per loop on the first batch, which the run has already
pulled: a chunk of a few copies of it runs with 1 and with all its steps valid (the device
loop's trip count is a runtime value, so one compiled program gives both), and
`step = (t_full - t_one) / (copies - 1)`, `overhead = t_one - step` plus the latency of one
`device_put`. Nothing is consumed from the data, and the real step state is only read (the
probe runs on private copies of it).

Example:
    >>> import fuseloop as fl, numpy as np, optax
    >>> loop = fl.trainer(fl.models.mlp([8, 2]), "sparse_categorical_cross_entropy",
    ...                   optax.sgd(0.1))
    >>> data = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))] * 8
    >>> print(fl.diagnostics.report(loop, data, fuse=4))  # doctest: +SKIP
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._placement import device_signature
from ._programs import Programs
from ._step import init_tail

__all__ = ["Report", "ChunkDecision", "report", "choose_chunk_size", "count_fusions",
           "DEFAULT_BUDGET_BYTES", "DEFAULT_MAX_CHUNK", "DEFAULT_TOLERANCE"]

DEFAULT_BUDGET_BYTES = 64 * 2**20
DEFAULT_MAX_CHUNK = 1024
DEFAULT_TOLERANCE = 0.02
_PROBE_COPIES = 8
_PROBE_REPEATS = 5
_DECISION = "auto_chunk_decision"

# An HLO instruction whose opcode is `fusion`: `%name = <type> fusion(<operands>), ...`.
_FUSION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\sfusion\(", re.MULTILINE)


def count_fusions(hlo_text: str) -> int:
    """Counts the `fusion` instructions in optimized HLO text (`compiled.as_text()`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.jit(lambda a: jnp.tanh(a + 1.0) * 2.0)
        >>> count_fusions(f.lower(jnp.ones(4)).compile().as_text()) >= 1
        True
    """
    return len(_FUSION.findall(hlo_text))


def _nbytes(tree: Any) -> int:
    return int(sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree)))


def _check_positive(value: Any, name: str, kind: type = int) -> None:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive {kind.__name__}")


# --------------------------------------------------------------------------- the probe
def _shardings(placement: Any) -> tuple[Any, Any]:
    """The state and chunk shardings of a mesh placement (None, None on one device)."""
    if placement is None or getattr(placement, "mesh", None) is None:
        return None, None
    return getattr(placement, "_state", None), getattr(placement, "_chunk", None)


def _probe(loop: Any, step_state: Any, batch: Any, placement: Any, copies: int,
           program: Any = None) -> tuple[float, float]:
    """`(step_seconds, overhead_seconds)` from a chunk of `copies` copies of `batch`, run
    with 1 and with up to `_PROBE_COPIES` valid steps.

    `program` is a compiled chunk program to reuse; by default the run's own (cached on the
    loop). Either way it may donate, as the run's does: each call gets a fresh private copy
    of the state, so the caller's step state is only read.
    """
    guard = loop.guard_nonfinite
    if program is None:
        program = Programs(loop).chunk()
    stacked = jax.tree.map(lambda a: np.repeat(np.asarray(a)[None], copies, axis=0), batch)
    state_sharding, chunk_sharding = _shardings(placement)
    try:
        chunk = jax.device_put(stacked, chunk_sharding)
    except ValueError:  # a batch the mesh cannot split: the run reports that itself
        state_sharding = chunk_sharding = None
        chunk = jax.device_put(stacked)
    tail = init_tail(loop.metrics, guard)
    steps = min(copies, _PROBE_COPIES)
    counts = {n: jax.device_put(np.int32(n), state_sharding) for n in (1, steps)}

    def seconds(n_valid: int) -> float:
        # Private copies (untimed): a donating program consumes them, the real state stays.
        carry = jax.block_until_ready(jax.device_put(
            jax.tree.map(lambda a: jnp.array(a, copy=True), (step_state, tail)),
            state_sharding))
        began = time.perf_counter()
        jax.block_until_ready(program(*carry, chunk, counts[n_valid]))
        return time.perf_counter() - began

    def put_one() -> float:
        began = time.perf_counter()
        jax.block_until_ready(jax.device_put(batch))
        return time.perf_counter() - began

    seconds(steps)  # compiles (unless reused) and warms up
    one, full, put = [], [], []
    for _ in range(_PROBE_REPEATS):  # interleaved, so all see the same machine load
        one.append(seconds(1))
        full.append(seconds(steps))
        put.append(put_one())
    # Minima are the least disturbed by other work on the machine. The fixed cost of a
    # chunk is its dispatch and wait plus one transfer's latency (its bytes are paid per
    # batch whatever K is, so they do not enter the choice).
    step = max((min(full) - min(one)) / (steps - 1), 1e-9)
    return step, max(min(one) - step, 0.0) + min(put)


# --------------------------------------------------------------------------- fuse="auto"
@dataclass(frozen=True)
class ChunkDecision:
    """What `choose_chunk_size` measured and chose (kept on the loop for diagnostics).

    Attributes:
        chunk_size: The chosen K.
        step_us: Measured device time of one step, in microseconds (None if not measured).
        overhead_us: Measured fixed cost of one dispatch, in microseconds.
        wanted: The K that meets the tolerance before any cap.
        memory_cap: The largest K whose stacked chunk fits the budget.
        bound: What decided K: "tolerance", "memory budget", "max_chunk" or "epoch length".
    """

    chunk_size: int
    step_us: float | None
    overhead_us: float | None
    wanted: int
    memory_cap: int
    bound: str


def _balance(k: int, epoch_length: int | None) -> int:
    """The smallest chunk size that runs the epoch in as many chunks as `k` does."""
    if not epoch_length:
        return k
    chunks = math.ceil(epoch_length / k)
    return math.ceil(epoch_length / chunks)


def choose_chunk_size(loop: Any, step_state: Any, first_batch: Any, *, placement: Any = None,
                      budget_bytes: int = DEFAULT_BUDGET_BYTES,
                      max_chunk: int = DEFAULT_MAX_CHUNK, tolerance: float = DEFAULT_TOLERANCE,
                      epoch_length: int | None = None) -> int:
    """Picks the chunk size K for `run(fuse="auto")` with the cost model in this module's
    docstring: enough steps per dispatch that dispatch overhead stays below `tolerance` of
    the step time, never a chunk larger than `budget_bytes`.

    Measures once per loop and batch shape (the result is cached on the loop).

    Args:
        loop: The Loop being run.
        step_state: The initial step state (only read, never donated).
        first_batch: The batch the run already pulled (no data is consumed).
        placement: The run's `Placement` (its mesh, if any, is used for the probe).
        budget_bytes: Memory budget for one stacked chunk.
        max_chunk: Upper bound on K.
        tolerance: Acceptable dispatch overhead as a fraction of the step time.
        epoch_length: Batches per epoch, when known: caps K and balances the chunks.

    Returns:
        K, an int >= 1.

    Example:
        >>> k = choose_chunk_size(loop, step_state, batch)  # doctest: +SKIP
    """
    _check_positive(budget_bytes, "budget_bytes")
    _check_positive(max_chunk, "max_chunk")
    _check_positive(tolerance, "tolerance", float)
    if epoch_length is not None:
        _check_positive(epoch_length, "epoch_length")
    batch_bytes = max(_nbytes(first_batch), 1)
    memory_cap = max(1, budget_bytes // batch_bytes)
    caps = {"memory budget": memory_cap, "max_chunk": max_chunk,
            "epoch length": epoch_length or max_chunk}
    cap_name = min(caps, key=lambda name: caps[name])
    cap = caps[cap_name]
    if cap == 1:
        decision = ChunkDecision(1, None, None, 1, memory_cap, cap_name)
    else:
        decision = _decide(loop, step_state, first_batch, placement, tolerance, cap, cap_name,
                           memory_cap, epoch_length)
    loop._cache[_DECISION] = decision
    return decision.chunk_size


def _decide(loop: Any, step_state: Any, batch: Any, placement: Any, tolerance: float,
            cap: int, cap_name: str, memory_cap: int, epoch_length: int | None
            ) -> ChunkDecision:
    key = ("auto_chunk_probe", device_signature(batch), id(getattr(placement, "mesh", None)))
    if key not in loop._cache:
        copies = max(2, min(_PROBE_COPIES, memory_cap))
        # The probe's transfers (copies of the first batch, fresh accumulators) are the
        # library's own, not data the caller's transfer guard is watching for.
        with jax.transfer_guard("allow"):
            loop._cache[key] = _probe(loop, step_state, batch, placement, copies)
    step, overhead = loop._cache[key]
    wanted = max(1, math.ceil(overhead / (tolerance * step)))
    k = 1 << (wanted - 1).bit_length()  # the next power of two: few distinct programs
    bound = "tolerance"
    if k >= cap:
        k, bound = cap, cap_name
    k = max(1, min(_balance(k, epoch_length), cap))
    return ChunkDecision(k, step * 1e6, overhead * 1e6, wanted, memory_cap, bound)


# --------------------------------------------------------------------------- report
@dataclass(frozen=True)
class Report:
    """Per-epoch costs of a loop, fused and unfused (`str(report)` is the readable form).

    Attributes:
        chunk_size: K of the fused run.
        iterations: Steps per epoch.
        fused: Counters of one fused epoch: dispatches, host_syncs, h2d_transfers,
            h2d_bytes, compiles (in the run that compiled it), us_per_iteration.
        unfused: The same for `fuse=False`.
        step_fusions: XLA fusions in the compiled single step.
        chunk_fusions: XLA fusions in the compiled fused chunk program.
        step_us: Measured device time of one step.
        dispatch_overhead_us: Measured fixed cost of one dispatch.
        auto: The `fuse="auto"` decision, when `fuse="auto"` was reported.
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
            f" (unfused {u['h2d_transfers']:g}, {_kib(u['h2d_bytes'])})",
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
    return {"dispatches": stats["dispatches"], "host_syncs": stats["host_syncs"],
            "h2d_transfers": stats["h2d_transfers"],
            "h2d_bytes": stats["h2d_transfers"] * transfer_bytes, "compiles": stats["compiles"]}


def _program_fusions(loop: Any, step_state: Any, batch: Any, chunk_size: int
                     ) -> tuple[int, int, Any]:
    """XLA fusions of the run's unfused-step and chunk programs, and the chunk program.

    They are the loop's cached programs, already compiled by the runs the report made, so
    lowering them again compiles nothing new.
    """
    programs = Programs(loop)
    tail = init_tail(loop.metrics, loop.guard_nonfinite)
    one = np.int32(1)
    step_text = programs.unfused().lower(step_state, tail, batch, one).compile().as_text()
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct((chunk_size,) + np.shape(a),
                                                        np.asarray(a).dtype), batch)
    chunk_program = programs.chunk()
    chunk_text = chunk_program.lower(step_state, tail, chunk, one).compile().as_text()
    return count_fusions(step_text), count_fusions(chunk_text), chunk_program


def report(loop: Any, data: Any, fuse: Any = 32, *, init_state: Any = None, reps: int = 3,
           iterations: int | None = None) -> Report:
    """Runs one epoch of `loop` fused and unfused (plus `reps` timed epochs of each) and
    reports dispatches, host syncs, transfers, compiles, XLA fusions and dispatch overhead.

    The loop runs as built, handlers included. `data` must be re-iterable (a list, an
    `fl.data.arrays` source): each run starts a fresh pass.

    Args:
        loop: The Loop to diagnose.
        data: Re-iterable data.
        fuse: The chunk size to report (a positive int, True for 32, or "auto").
        init_state: Passed to `run` (an evaluator needs its params).
        reps: Timed epochs of each kind; the median is reported.
        iterations: Bound on iterations per epoch.

    Returns:
        A `Report`; `print(report)` shows it in a few lines.

    Example:
        >>> print(fl.diagnostics.report(loop, batches, fuse=32))  # doctest: +SKIP
    """
    _check_positive(reps, "reps")
    if fuse is False or fuse is None:
        raise ValueError("fuse=False: report compares a fused run with the unfused one; pass "
                         "fuse=<chunk size>, True or 'auto'")
    if iter(data) is data:
        raise ValueError("data: report runs several epochs, so it needs re-iterable data "
                         "(a list of batches or fl.data.arrays(...)), not a one-shot iterator")
    run = lambda k: loop.run(data, init_state, fuse=k, iterations=iterations)  # noqa: E731
    first_fused, first_unfused = run(fuse), run(False)
    n_iter = max(first_unfused.stats["dispatches"], 1)  # one dispatch per step unfused
    times: dict[str, list[float]] = {"fused": [], "unfused": []}
    for _ in range(reps):  # interleaved, so both see the same machine load
        times["unfused"].append(_epoch_seconds(run(False)))
        times["fused"].append(_epoch_seconds(run(fuse)))
    batch = next(iter(data))
    batch_bytes = _nbytes(batch)
    k = int(first_fused.stats["chunk_size"])
    fused = _counters(first_fused, k * batch_bytes + 4)  # + the chunk's int32 count
    unfused = _counters(first_unfused, batch_bytes)
    if getattr(data, "resident", False):  # a device-resident source moves the dataset once
        whole = _nbytes((data.x, data.y))
        fused["h2d_bytes"] = fused["h2d_transfers"] * whole
    fused["us_per_iteration"] = statistics.median(times["fused"]) / n_iter * 1e6
    unfused["us_per_iteration"] = statistics.median(times["unfused"]) / n_iter * 1e6
    step_state = first_fused.step_state
    step_fusions, chunk_fusions, chunk = _program_fusions(loop, step_state, batch, k)
    # The probe reuses the run's chunk program (K slots), so it compiles nothing new.
    step_s, overhead_s = (_probe(loop, step_state, batch, None, k, chunk) if k > 1 else
                          _probe(loop, step_state, batch, None, _PROBE_COPIES))
    auto = loop._cache.get(_DECISION) if fuse == "auto" else None
    return Report(k, n_iter, fused, unfused, step_fusions, chunk_fusions, step_s * 1e6,
                  overhead_s * 1e6, auto)
