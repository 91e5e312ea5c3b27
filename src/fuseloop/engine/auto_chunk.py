"""The cost model behind `run(fuse="auto")`: how many steps one dispatch should run.

A fused chunk of K steps costs about `overhead + K * step`, where `overhead` is the fixed
price of one dispatch (the call, the chunk's transfer latency, the wait) and `step` the
device time of one step. Per iteration that is `step * (1 + overhead / (K * step))`, so K is
the smallest power of two with `overhead / (K * step) <= tolerance` (2% by default), then
capped:

  * by the memory budget: `K * bytes(batch) <= budget_bytes` (64 MiB by default) - the
    stacked chunk never exceeds it;
  * by `max_chunk` (1024) and, when known, by the epoch length, whose chunks are then
    balanced (100 batches with K=64 run as two chunks of 50, not 64 + 36 padded slots).

Both figures are measured once per loop on the first batch, which the run has already
pulled: a chunk of a few copies of it runs with 1 and with all its steps valid (the device
loop's trip count is a runtime value, so one compiled program gives both), and
`step = (t_full - t_one) / (copies - 1)`, `overhead = t_one - step` plus the latency of one
`device_put`. Nothing is consumed from the data, and the real step state is only read (the
probe runs on private copies of it). The timings are kept in the loop's program cache.

On a run that may cross epochs (device-resident data, docs/design.md §9), the same K decides
how many whole epochs one dispatch covers (`epochs_per_dispatch`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .._copies import private_copy
from .._fusion import DEFAULT_CHUNK
from .._leafless import repeated
from .._placement import Placement, device_signature
from .._state import State
from .programs import Programs

__all__ = [
    "ChunkDecision",
    "decide_chunk_size",
    "choose_chunk_size",
    "epochs_per_dispatch",
    "as_placement",
    "probe",
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_MAX_CHUNK",
    "DEFAULT_TOLERANCE",
    "PROBE_COPIES",
]

DEFAULT_BUDGET_BYTES = 64 * 2**20
DEFAULT_MAX_CHUNK = 1024
DEFAULT_TOLERANCE = 0.02
PROBE_COPIES = 8
_PROBE_REPEATS = 5


def nbytes(tree: Any) -> int:
    return int(sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree)))


def check_positive(value: Any, name: str, kind: type = int) -> None:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or not value > 0:  # (NaN is not > 0)
        raise ValueError(f"{name}={value!r} must be a positive {kind.__name__}")


# --------------------------------------------------------------------------- the probe
def require(value: Any, kind: type, argument: str, example: str) -> None:
    """A ValueError naming `argument` where `value` is not a `kind` (the diagnostics'
    entry points, which would otherwise fail on a missing attribute)."""
    if not isinstance(value, kind):
        raise ValueError(
            f"{argument}: expected a fuseloop {kind.__name__} ({example}), got "
            f"{type(value).__name__}"
        )


def checked_programs(loop: Any, step_state: Any, first_batch: Any) -> tuple[Programs, Any]:
    """The loop's programs and the initial step state (None: the loop's own fresh one),
    once the checks a run makes of its first batch and that state have passed (before the
    probe traces them): an x that does not fit the model gets the run's message, not the
    model library's, and an empty batch is named."""
    from .._checks import Checker

    evaluator = loop.program.kind == "evaluator"
    if isinstance(step_state, State) and not evaluator:
        raise ValueError(
            "step_state: expected the step state a run starts from, got a State: pass "
            "state.step_state (or None for the loop's own fresh one)"
        )
    programs = Programs(loop)
    leaves = jax.tree.leaves(first_batch)
    if leaves and any(np.shape(leaf)[:1] == (0,) for leaf in leaves):
        raise ValueError("first_batch: holds no examples; pass a batch of the data")
    checker = Checker(programs.loop.program, programs.cache.verdicts)
    checker.first(first_batch)
    if evaluator:
        step_state = _evaluated(loop, step_state, first_batch)
    else:
        step_state = _fresh_if_none(loop, step_state, first_batch)
    checker.variables(step_state)
    return programs, step_state


def _fresh_if_none(loop: Any, step_state: Any, first_batch: Any) -> Any:
    """`step_state`, or where it is None the loop's own initial one for `first_batch` (a
    trainer's fresh variables and optimizer state; a custom loop's `init_fn`'s)."""
    if step_state is not None:
        return step_state
    # A trainer's fresh init moves its own values (its key), which its run's compiled init
    # makes on the device; a custom loop's init_fn is the user's code, guarded as in a run.
    trainer = loop.program.kind == "trainer"
    with jax.transfer_guard("allow") if trainer else contextlib.nullcontext():
        made = loop.program.init(first_batch, None)
    if made is None:
        raise ValueError(
            "step_state=None: this loop makes no step state of its own (fl.loop without "
            "init_fn); pass the one its runs start from"
        )
    return made


def _evaluated(loop: Any, variables: Any, first_batch: Any) -> Any:
    """An evaluator's step state for the variables (or State) its run would be given."""
    from ..models import weights_of_module  # (an nnx or equinox module: its weights)

    if isinstance(variables, State):
        variables = variables.params
    if variables is None:
        raise ValueError(
            "step_state=None: an evaluator has no step state of its own; pass the trained "
            "variables it evaluates (state.params, or the State), as its run takes them"
        )
    return loop.program.init(first_batch, weights_of_module(variables, "step_state"))


def as_placement(placement: Any) -> Any:
    """A public function's `placement=`: None (one device), a run's mesh (a
    `jax.sharding.Mesh`, as `run(mesh=...)` takes) or a run's own placement; anything else
    is refused (it would be ignored, and the probe would run on one device)."""
    if placement is None or isinstance(placement, Placement):
        return placement
    if isinstance(placement, jax.sharding.Mesh):
        return Placement(placement, {})
    raise ValueError(
        f"placement={placement!r} must be the run's mesh, a jax.sharding.Mesh with a 'data' "
        f"axis (as run(mesh=...) takes), or None for one device"
    )


def _shardings(placement: Any) -> tuple[Any, Any]:
    """The state and chunk shardings of a mesh placement (None, None on one device)."""
    if placement is None or getattr(placement, "mesh", None) is None:
        return None, None
    return getattr(placement, "_state", None), getattr(placement, "_chunk", None)


def _has_effects(program: Any, *args: Any) -> bool:
    """Whether `program`'s step has side effects (`jax.debug.print`, `io_callback`, ...):
    the trace a call would make anyway (jax keeps it), so nothing is traced twice."""
    trace = getattr(program, "trace", None)
    return trace is not None and bool(trace(*args).jaxpr.effects)


def probe(
    programs: Programs,
    step_state: Any,
    batch: Any,
    placement: Any,
    copies: int,
    program: Any = None,
    effects_ok: bool = False,
) -> tuple[float, float] | None:
    """`(step_seconds, overhead_seconds)` from a chunk of `copies` copies of `batch`, run
    with 1 and with up to `PROBE_COPIES` valid steps; None, running nothing, where the step
    has side effects (a callback would see some 50 steps that are not the run's), unless
    `effects_ok` (a report, which runs the loop again and again anyway).

    `program` is a compiled chunk program to reuse; by default the run's own (cached on the
    loop). Either way it may donate, as the run's does: each call gets a fresh private copy
    of the state, so the caller's step state is only read.
    """
    if program is None:
        program = programs.chunk()
    stacked = repeated(batch, copies)
    state_sharding, chunk_sharding = _shardings(placement)
    try:
        chunk = jax.device_put(stacked, chunk_sharding)
    except ValueError:  # a batch the mesh cannot split: the run reports that itself
        state_sharding = chunk_sharding = None
        chunk = jax.device_put(stacked)
    # The run's own accumulators (a population's have a member axis and its active flags).
    tail = programs.fresh_tail()
    steps = min(copies, PROBE_COPIES)
    counts = {n: jax.device_put(np.int32(n), state_sharding) for n in (1, steps)}
    if not effects_ok and _has_effects(program, step_state, tail, chunk, counts[steps]):
        return None

    def seconds(n_valid: int) -> float:
        # Private copies (untimed): a donating program consumes them, the real state stays.
        carry = jax.block_until_ready(
            jax.device_put(private_copy((step_state, tail)), state_sharding)
        )
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
    """What `decide_chunk_size` measured and chose.

    Attributes:
        chunk_size: The chosen K.
        step_us: Measured device time of one step, in microseconds (None if not measured).
        overhead_us: Measured fixed cost of one dispatch, in microseconds.
        wanted: The K that meets the tolerance before any cap.
        memory_cap: The largest K whose stacked chunk fits the budget.
        bound: What decided K: "tolerance", "memory budget", "max_chunk", "epoch length",
            "side effects" (a step with callbacks is not timed: K is `fuse=True`'s 32,
            balanced to the epoch) or "several processes" (under jax.distributed nothing
            is timed either: each process's timing could pick another K, and every process
            must run the same programs).

    Example:
        >>> step_state = loop.run(batches).step_state
        >>> decision = fl.diagnostics.decide_chunk_size(loop, step_state, batches[0], max_chunk=3)
        >>> decision.chunk_size, decision.bound, decision.memory_cap > 3
        (3, 'max_chunk', True)
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


def decide_chunk_size(
    programs: Programs,
    step_state: Any,
    first_batch: Any,
    *,
    placement: Any = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    tolerance: float = DEFAULT_TOLERANCE,
    epoch_length: int | None = None,
) -> ChunkDecision:
    """Chooses K with the cost model in this module's docstring; see
    `fuseloop.diagnostics.decide_chunk_size` for the arguments.
    """
    check_positive(budget_bytes, "budget_bytes")
    check_positive(max_chunk, "max_chunk")
    check_positive(tolerance, "tolerance", float)
    if epoch_length is not None:
        check_positive(epoch_length, "epoch_length")
    memory_cap = max(1, budget_bytes // max(nbytes(first_batch), 1))
    caps = {
        "memory budget": memory_cap,
        "max_chunk": max_chunk,
        "epoch length": epoch_length or max_chunk,
    }
    cap_name = min(caps, key=lambda name: caps[name])
    cap = caps[cap_name]
    if cap == 1:
        return ChunkDecision(1, None, None, 1, memory_cap, cap_name)
    timings = _timings(programs, step_state, first_batch, placement, memory_cap)
    if timings is None:  # not timed: fuse=True's chunk
        k = max(1, min(_balance(DEFAULT_CHUNK, epoch_length), cap))
        untimed = "side effects" if jax.process_count() == 1 else "several processes"
        bound = cap_name if cap < DEFAULT_CHUNK else untimed
        return ChunkDecision(k, None, None, DEFAULT_CHUNK, memory_cap, bound)
    step, overhead = timings
    wanted = max(1, math.ceil(overhead / (tolerance * step)))
    k = 1 << (wanted - 1).bit_length()  # the next power of two: few distinct programs
    bound = "tolerance"
    if k >= cap:
        k, bound = cap, cap_name
    k = max(1, min(_balance(k, epoch_length), cap))
    return ChunkDecision(k, step * 1e6, overhead * 1e6, wanted, memory_cap, bound)


def choose_chunk_size(programs: Programs, step_state: Any, first_batch: Any, **options: Any) -> int:
    """The K of `decide_chunk_size` (what `run(fuse="auto")` uses)."""
    return decide_chunk_size(programs, step_state, first_batch, **options).chunk_size


def epochs_per_dispatch(
    programs: Programs,
    step_state: Any,
    first_batch: Any,
    *,
    epoch_length: int,
    placement: Any = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    max_chunk: int = DEFAULT_MAX_CHUNK,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[int, str]:
    """Whole epochs per dispatch for `run(fuse="auto")` on a run that may cross epochs
    (device-resident data; docs/design.md §9), and what decided it (for
    `stats["whole_run"]`). 1 keeps chunks within the epoch.

    The cost model above, applied across epochs: when the K that meets the tolerance
    exceeds the epoch, a dispatch covers `ceil(K / epoch_length)` whole epochs. A dispatch
    gathers one epoch's batches at a time, so crossing needs the epoch itself within the
    memory budget and `max_chunk`.
    """
    check_positive(epoch_length, "epoch_length")
    memory_cap = max(1, budget_bytes // max(nbytes(first_batch), 1))
    if epoch_length > min(memory_cap, max_chunk):
        return 1, "an epoch's batches exceed the memory budget or max_chunk"
    timings = _timings(programs, step_state, first_batch, placement, memory_cap)
    if timings is None:  # not timed: chunks within the epoch
        if jax.process_count() > 1:
            return 1, "not timed under several processes"
        return 1, "not timed: the step has side effects"
    step, overhead = timings
    wanted = max(1, math.ceil(overhead / (tolerance * step)))
    return (1 if wanted <= epoch_length else math.ceil(wanted / epoch_length)), "cost model"


def _timings(
    programs: Programs, step_state: Any, batch: Any, placement: Any, memory_cap: int
) -> tuple[float, float] | None:
    """`(step_s, overhead_s)`, measured once per loop, batch signature and mesh (None: the
    step has side effects, or the run has several processes, and is not timed)."""
    if jax.process_count() > 1:  # each process's own timing could choose another K
        return None
    key = (device_signature(batch), id(getattr(placement, "mesh", None)))
    if key not in programs.cache.probe:
        copies = max(2, min(PROBE_COPIES, memory_cap))
        # The probe's transfers (copies of the first batch, fresh accumulators) are the
        # library's own, not data the caller's transfer guard is watching for.
        with jax.transfer_guard("allow"):
            programs.cache.probe[key] = probe(programs, step_state, batch, placement, copies)
    return programs.cache.probe[key]
