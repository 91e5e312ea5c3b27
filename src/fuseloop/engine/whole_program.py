"""The multi-epoch device loop: one dispatch that crosses epoch boundaries on
device-resident data (docs/design.md §9).

    while steps remain:                          # one trip per epoch piece ("segment")
        if the epoch is over:                    # the epoch boundary, on the device
            zero the accumulators; order <- epoch_order(seed, epoch); cursor <- 0
        gather the rest of the epoch from `order`; run the one device loop over it
        keep the segment's records, its final accumulators, its steps run, its flag
        (the records of every segment where an iteration handler replays them, else
        only the last segment's, never read: see `write_segment`)

The inner loop is the same `make_chunk_fn` loop every other program runs (docs/design.md
§2, "one loop body for every K"), so each step is bitwise the step of a per-epoch run. The
boundary work happens only between segments, and only when the dispatch continues past
the epoch's end: a dispatch that ends at an epoch's end leaves the carry exactly where a
per-epoch run leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._epoch_order import EpochOrder
from .._step import init_tail
from .device_monitors import epoch_end_fn
from .packing import pack_leaves
from .programs import MIN_SLOTS, _source_key

__all__ = [
    "compiled_segments",
    "piece_steps",
    "whole_run_key",
    "whole_run_program",
    "segments_for",
    "host_outputs",
    "slot_rows",
    "put_at",
    "record_buffers",
    "write_segment",
]

KEPT_RECORDS = "kept_records"  # the last segment's records, kept but never read


def segments_for(cursor: int, steps: int, limit: int) -> list[tuple[int, int]]:
    """The `(first iteration, steps)` epoch pieces of a dispatch of `steps` steps that
    starts at iteration `cursor` of an epoch of `limit` steps (what the device loop runs).

    Example:
        >>> segments_for(3, 9, 5)
        [(3, 2), (0, 5), (0, 2)]
    """
    out = []
    while steps > 0:
        n = min(steps, limit - cursor)
        out.append((cursor, n))
        steps -= n
        cursor = 0
    return out


def whole_run_program(
    programs: Any,
    source: Any,
    segments: int,
    piece: int,
    sharding: Any,
    work: Any,
    record: bool = True,
) -> Any:
    """The cached multi-epoch program for `segments` epoch pieces of `piece` step slots
    (`piece_steps`; `inputs["limit"]`, the epoch's length under the run's `iterations=`
    bound, is an input, so bounds that share the slots share the program),
    with the device's epoch-end `work` (`device_monitors.DeviceWork`); `record=False` (no
    iteration handler replays the records) leaves `records` out of `out`, so XLA drops
    their writes from the loop (the loop body itself is unchanged).

    `(state, tail, data, order, epoch, cursor, steps, monitor, validation) -> (state, tail,
    out, order, epoch, cursor)`, where `out` holds per segment: `records` [segments, slots],
    `final` (the accumulators at the segment's end), `n_run`, `nonfinite`, and at epoch
    ends `validation` (the evaluator's accumulators) and `stop` (early stopping's
    verdict); `out["extra"]` is the monitor's record and the best step state. `epoch` is
    the device epoch counter (the next epoch whose order is computed), as in the resident
    feed.
    """
    key = whole_run_key(source, segments, piece, sharding, work, record)
    cache = programs.cache.whole_run
    if key not in cache:
        fn = _build(programs, source, segments, piece, sharding, work, record)
        cache[key] = programs._jit(fn)
    return cache[key]


def compiled_segments(cache: dict[Any, Any], at_least: int, key_of: Any) -> int | None:
    """The fewest segments, a power of two from `at_least` up to `_LARGER` times it, of a
    multi-epoch program already in `cache` under `key_of(segments)` (None: none): its
    unused segments run nothing, so a shorter dispatch (a resumed run's last epochs) takes
    it instead of compiling another. The bound keeps a short dispatch from reading back
    the per-segment outputs of a far longer run's program.
    """
    segments = at_least
    while segments <= at_least * _LARGER:
        if key_of(segments) in cache:
            return segments
        segments *= 2
    return None


_LARGER = 16


def whole_run_key(
    source: Any, segments: int, piece: int, sharding: Any, work: Any, record: bool
) -> tuple[Any, ...]:
    """What a solo run's multi-epoch program is cached by."""
    return (_source_key(source).layout, segments, piece, sharding, work.key, record)


def _build(
    programs: Any,
    source: Any,
    segments: int,
    slots: int,
    sharding: Any,
    work: Any,
    record: bool,
) -> Callable[..., Any]:
    guard = programs.guard
    start_work, end_work = epoch_end_fn(work, segments)
    metrics, layout = programs.loop.metrics, _source_key(source).layout

    def program(
        state: Any,
        tail: Any,
        data: Any,
        order: Any,
        epoch: Any,
        cursor: Any,
        steps: Any,
        monitor: Any,
        inputs: Any,
    ) -> tuple[Any, ...]:
        extra = start_work(state, monitor)
        shapes = jax.eval_shape(end_work, state, tail["acc"], extra, 0, inputs)[2]
        out = _buffers(segments, slots, tail["acc"], shapes, record)
        epoch_end = _epoch_end(end_work, inputs, shapes)
        boundary = _boundary(metrics, guard, layout, inputs["order_key"])
        body = programs.resident_loop(data, sharding)  # each step gathers its batch
        limit = inputs["limit"]
        step = _segment_step(body, slot_rows(slots), boundary, epoch_end, limit, guard, record)

        zero = jnp.zeros((), jnp.int32)
        stopped = jnp.zeros((), jnp.bool_)
        carry = (zero, steps, state, tail, order, epoch, cursor, out, extra, stopped)
        carry = lax.while_loop(_going(segments, guard), step, carry)
        _, _, state, tail, order, epoch, cursor, out, extra, _ = carry
        packed = pack_leaves(host_outputs(out, extra))  # read as a few buffers
        return state, tail, {**out, "extra": extra, "packed": packed}, order, epoch, cursor

    return program


def host_outputs(out: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """What the host reads of a dispatch's output: the per-segment buffers (the records
    only where recorded) and the monitor's and the ring's counters. The program packs it
    (`out["packed"]`); the host unpacks it by this tree's shapes.
    """
    read = {k: v for k, v in out.items() if k not in ("extra", "packed", KEPT_RECORDS)}
    read["best_s"] = extra["best_s"]
    if "kept_n" in extra:
        read["kept_n"] = extra["kept_n"]
    return read


def _epoch_end(end_work: Any, inputs: Any, shapes: Any) -> Callable[..., tuple[Any, ...]]:
    """`(at_end, state, acc, extra, s) -> (state, extra, per-epoch outputs)`: the device's
    epoch-end work where a segment ends its epoch, zeros elsewhere.
    """

    def ended(state: Any, acc: Any, extra: Any, s: Any) -> tuple[Any, ...]:
        return end_work(state, acc, extra, s, inputs)

    def running(state: Any, acc: Any, extra: Any, s: Any) -> tuple[Any, ...]:
        return state, extra, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)

    def epoch_end(at_end: Any, state: Any, acc: Any, extra: Any, s: Any) -> tuple[Any, ...]:
        return lax.cond(at_end, ended, running, state, acc, extra, s)

    return epoch_end


def _segment_step(
    body: Any, rows: Any, boundary: Any, epoch_end: Any, limit: Any, guard: bool, record: bool
) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """One trip of the dispatch's loop: an epoch piece and, at its epoch's end, the
    device's epoch-end work.
    """

    def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        s, remaining, state, tail, order, epoch, cursor, out, extra, _ = carry
        tail, order, epoch, cursor = lax.cond(
            cursor >= limit, boundary, _keep, tail, order, epoch, cursor
        )
        n = jnp.minimum(remaining, limit - cursor)
        state, tail, records, n_run = body(state, tail, rows(order, cursor), n)
        flag = tail["nonfinite"] if guard else jnp.zeros((), jnp.bool_)
        at_end = (cursor + n_run == limit) & ~flag
        state, extra, epoch_out = epoch_end(at_end, state, tail["acc"], extra, s)
        segment = {"final": tail["acc"], "n_run": n_run, "nonfinite": flag}
        out = write_segment(out, {**epoch_out, **segment}, records, s, record)
        # The dispatch ends after an early stop, or when the kept best states are full.
        stopped = epoch_out["stop"] | extra.get("flush", False)
        cursor = cursor + n_run
        return s + 1, remaining - n_run, state, tail, order, epoch, cursor, out, extra, stopped

    return step


def piece_steps(source: Any, limit: int, record: bool) -> int:
    """The step slots of one epoch piece, for an epoch of `limit` steps (the run's
    `iterations=` bound, the program's input): a whole epoch's batches, so a run of any
    bound takes the program; where the steps' records come back to the host (`record`),
    the bound rounded up to a power of two, so that read grows with the bound, not with
    the epoch."""
    if record:
        return max(min(source.num_batches, 1 << (limit - 1).bit_length()), MIN_SLOTS)
    return max(source.num_batches, MIN_SLOTS)


def slot_rows(slots: int) -> Callable[..., Any]:
    """`(order, cursor) -> rows`: the dataset rows of the `slots` batches from `cursor`."""

    def rows(order: Any, cursor: Any) -> Any:
        # Slots past the epoch's end take clamped (valid) rows; they are never stepped.
        return order[jnp.minimum(cursor + jnp.arange(slots), order.shape[0] - 1)]

    return rows


def _boundary(
    metrics: Any, guard: bool, plan: EpochOrder, seed_key: Any
) -> Callable[..., tuple[Any, ...]]:
    """The epoch's end inside the dispatch: fresh accumulators, the next order (`plan` is
    the order's layout; the seed's key is the dispatch's input)."""

    def boundary(tail: Any, order: Any, epoch: Any, cursor: Any) -> tuple[Any, ...]:
        fresh = init_tail(metrics, guard)
        next_order = plan.batches(epoch, seed_key)
        return fresh, next_order, epoch + 1, jnp.zeros((), jnp.int32)

    return boundary


def _keep(tail: Any, order: Any, epoch: Any, cursor: Any) -> tuple[Any, ...]:
    return tail, order, epoch, cursor


def _buffers(
    segments: int, slots: int, acc: Any, epoch_shapes: Any, record: bool
) -> dict[str, Any]:
    """The dispatch's per-segment output buffers, zeroed."""

    def per_segment(a: Any) -> Any:
        return jnp.zeros((segments,) + a.shape, a.dtype)

    out = {
        **jax.tree.map(per_segment, epoch_shapes),
        "final": jax.tree.map(per_segment, acc),
        "n_run": jnp.zeros((segments,), jnp.int32),
        "nonfinite": jnp.zeros((segments,), jnp.bool_),
    }
    return {**out, **record_buffers(segments, slots, acc, record)}


def record_buffers(segments: int, slots: int, acc: Any, record: bool) -> dict[str, Any]:
    """The dispatch's zeroed records buffer: per segment where recorded, else one
    segment's (`write_segment`)."""
    if record:
        return {
            "records": jax.tree.map(lambda a: jnp.zeros((segments, slots) + a.shape, a.dtype), acc)
        }
    return {KEPT_RECORDS: jax.tree.map(lambda a: jnp.zeros((slots,) + a.shape, a.dtype), acc)}


def write_segment(out: Any, segment: Any, records: Any, s: Any, record: bool) -> Any:
    """`out` with `segment`'s values written at index `s`, and its `records`: at `s` where
    an iteration handler replays them, else in place of the last segment's.

    Records nobody reads are still kept, as an output of the program: XLA drops an unused
    output's writes from the loop, and the loop without them is fused otherwise (an index
    once shared with the writes moves into the step's own kernels), which rounded a
    step's `jnp.mean` otherwise than the per-epoch programs do (docs/design.md §2).
    """
    if record:
        return put_at(out, {**segment, "records": records}, s)
    per_segment = {k: v for k, v in out.items() if k != KEPT_RECORDS}
    return {**put_at(per_segment, segment, s), KEPT_RECORDS: records}


def _going(segments: int, guard: bool) -> Callable[[tuple[Any, ...]], Any]:
    def cond(carry: tuple[Any, ...]) -> Any:
        s, remaining, _, tail, *_, stopped = carry
        going = (s < segments) & (remaining > 0) & ~stopped
        if guard:
            going = going & ~tail["nonfinite"]
        return going

    return cond


def put_at(buffer: Any, value: Any, s: Any) -> Any:
    """`buffer` (a tree of arrays with a leading axis) with `value` written at index `s`."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, s, 0), buffer, value)
