"""The multi-epoch device loop of a population (docs/design.md §8 and §9).

The same loop as `whole_program.py` (segments of epochs, each running the one device loop,
the epoch boundary on the device), with the member axis:

* the segment's device loop is the population's (`population.member_chunk`: every member
  steps, inactive members get their carry back, a member whose guard tripped becomes
  inactive at the segment's end), so each step is the step of a per-epoch population run;
* the epoch-end work (`device_monitors.epoch_end_fn`) runs vmapped over the members, each
  member with its own monitor records, learning-rate table and best step state; a member
  that was inactive when its epoch ended keeps everything as it was (the host monitors
  skip halted members), and a member that early stopping stops becomes inactive (with
  `restore_best`, its best epoch's step state first, as the host handler restores it);
* the epoch boundary keeps the `active` mask, and the dispatch ends once no member is
  active (or at its steps, as any whole-run dispatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._epoch_order import EpochOrder
from .._fusion import make_chunk_fn
from .._step import make_carry_step
from .device_monitors import DeviceWork, Validation, epoch_end_fn, validation_loop
from .packing import pack_leaves
from .population import member_carry_step, member_chunk, population_tail
from .programs import _source_key
from .whole_program import host_outputs, record_buffers, slot_rows, write_segment

__all__ = ["population_whole_key", "population_whole_program"]


def population_whole_key(
    source: Any, segments: int, piece: int, work: Any, record: bool
) -> tuple[Any, ...]:
    """What a population's multi-epoch program is cached by."""
    return ("population", _source_key(source).layout, segments, piece, work.key, record)


def population_whole_program(
    programs: Any, source: Any, segments: int, piece: int, work: DeviceWork, record: bool = True
) -> Any:
    """The cached multi-epoch program of a population (`programs` is the population's).

    `(state, tail, data, order, epoch, cursor, steps, monitor, inputs) -> (state, tail,
    out, order, epoch, cursor)`, as `whole_program.whole_run_program`, where every value
    has the member axis and `out` also holds `active` (the members active at each
    segment's end, after the guard and before the epoch's monitors). `monitor` holds the
    device monitors' per-member records, `best_start` (each member's best step state so
    far, with `restore_best`) and `holds` (whether that copy is the member's best);
    `inputs["rates"]` is each member's rate table. `record=False` leaves the per-step
    records out, and the host's read is packed (`out["packed"]`), as in the solo program.
    """
    key = population_whole_key(source, segments, piece, work, record)
    cache = programs.cache.whole_run
    if key not in cache:
        size = programs.population.size
        fn = _build(programs, source, segments, piece, work, size, record)
        cache[key] = programs._jit(fn)
    return cache[key]


def _build(
    programs: Any,
    source: Any,
    segments: int,
    slots: int,
    work: DeviceWork,
    size: int,
    record: bool,
) -> Callable[..., Any]:
    epoch_end = _MemberEpochEnd(work, segments, size)
    metrics, guard, layout = programs.loop.metrics, programs.guard, _source_key(source).layout

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
        extra = epoch_end.start(state, monitor)
        shapes = jax.eval_shape(
            epoch_end.ended, state, tail["acc"], extra, tail["active"], 0, inputs
        )[2]
        out = _buffers(segments, slots, tail, shapes, record)
        body = programs.resident_loop(data)  # each step gathers its batch
        boundary = _boundary(metrics, guard, layout, size, inputs["order_key"])
        parts = (body, slot_rows(slots), boundary, epoch_end)
        step = _segment_step(parts, inputs, shapes, size, record)
        zero = jnp.zeros((), jnp.int32)
        carry = (zero, steps, state, tail, order, epoch, cursor, out, extra)
        carry = lax.while_loop(_going(segments), step, carry)
        _, _, state, tail, order, epoch, cursor, out, extra = carry
        packed = pack_leaves(host_outputs(out, extra))  # read as a few buffers
        return state, tail, {**out, "extra": extra, "packed": packed}, order, epoch, cursor

    return program


def _boundary(
    metrics: Any, guard: bool, plan: EpochOrder, size: int, seed_key: Any
) -> Callable[..., Any]:
    """The epoch's end inside the dispatch: fresh accumulators (stopped members stay
    stopped), the next order (`plan` is the order's layout; the seed's key is the
    dispatch's input)."""

    def boundary(tail: Any, order: Any, epoch: Any, cursor: Any) -> tuple[Any, ...]:
        fresh = {**population_tail(metrics, guard, size), "active": tail["active"]}
        return fresh, plan.batches(epoch, seed_key), epoch + 1, jnp.zeros((), jnp.int32)

    return boundary


def _keep(tail: Any, order: Any, epoch: Any, cursor: Any) -> tuple[Any, ...]:
    return tail, order, epoch, cursor


def _segment_step(
    parts: tuple[Any, ...], inputs: Any, shapes: Any, size: int, record: bool
) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """One trip of the dispatch's loop: an epoch piece for every member and, at its
    epoch's end, the members' epoch-end work."""
    body, rows, boundary, epoch_end = parts
    limit = inputs["limit"]  # the epoch's steps under the run's bound (an input)
    running = epoch_end.running(shapes)

    def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        s, remaining, state, tail, order, epoch, cursor, out, extra = carry
        tail, order, epoch, cursor = lax.cond(
            cursor >= limit, boundary, _keep, tail, order, epoch, cursor
        )
        n = jnp.minimum(remaining, limit - cursor)
        state, tail, records, n_run = body(state, tail, rows(order, cursor), n)
        active = tail["active"]  # after the guard, before the epoch's monitors
        at_end = cursor + n_run == limit
        state, extra, epoch_out, still = lax.cond(
            at_end, epoch_end.ended, running, state, tail["acc"], extra, active, s, inputs
        )
        segment = {
            "final": tail["acc"],
            "n_run": n_run,
            "nonfinite": tail.get("nonfinite", jnp.zeros((size,), jnp.bool_)),
            "active": active,
        }
        out = write_segment(out, {**epoch_out, **segment}, records, s, record)
        tail = {**tail, "active": still}
        return s + 1, remaining - n_run, state, tail, order, epoch, cursor + n_run, out, extra

    return step


def _going(segments: int) -> Callable[[tuple[Any, ...]], Any]:
    def going(carry: tuple[Any, ...]) -> Any:
        s, remaining, _, tail, *_, extra = carry
        going = (s < segments) & (remaining > 0) & jnp.any(tail["active"])
        if "flush" in extra:  # a member's ring of kept best states is full
            going = going & ~jnp.any(extra["flush"])
        return going

    return going


class _MemberEpochEnd:
    """The device's epoch-end work: the members' validation at once (the evaluator's
    population loop), then the monitors one member at a time (vmapped).
    """

    def __init__(self, work: DeviceWork, segments: int, size: int):
        init, end = epoch_end_fn(work, segments)
        self.restore = work.stopper is not None and work.stopper.handler.restore_best
        self.validate = _population_validation(work.validation, size)
        self._init = jax.vmap(init)
        self._end = jax.vmap(end, in_axes=(0, 0, 0, None, {"val_acc": 0, "rates": 0}))

    def start(self, state: Any, monitor: Any) -> dict[str, Any]:
        records = {k: v for k, v in monitor.items() if k not in ("best_start", "holds")}
        extra = self._init(state, records)
        if self.restore:  # each member's best so far (a copy made by the host)
            extra["best_state"] = monitor["best_start"]
            extra["holds"] = monitor["holds"]
        return extra

    def ended(
        self, state: Any, acc: Any, extra: Any, active: Any, s: Any, inputs: Any
    ) -> tuple[Any, ...]:
        """`(state, extra, per-epoch outputs, members still active)` at an epoch's end."""
        inner = {k: v for k, v in extra.items() if k != "holds"}
        val_acc = self.validate(state, inputs["validation"])
        members = {"val_acc": val_acc, "rates": inputs["rates"]}
        new_state, new_inner, flags = self._end(state, acc, inner, s, members)
        state = _where(active, new_state, state)
        inner = _where(active, new_inner, inner)
        flags = {k: (v & active if k != "validation" else v) for k, v in flags.items()}
        extra = {**extra, **inner}
        stop = flags["stop"]
        if self.restore:
            extra["holds"] = extra["holds"] | (active & (extra["best_s"] == s))
            state = _where(stop & extra["holds"], extra["best_state"], state)
        return state, extra, flags, active & ~stop

    def running(self, shapes: Any) -> Callable[..., tuple[Any, ...]]:
        def running(
            state: Any, acc: Any, extra: Any, active: Any, s: Any, inputs: Any
        ) -> tuple[Any, ...]:
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
            return state, extra, zeros, active

        return running


def _population_validation(v: Validation | None, size: int) -> Callable[[Any, Any], Any]:
    """`(state, (data, order)) -> every member's validation accumulators` (None without
    one): the evaluator's population device loop (`population.member_chunk`, as a
    population evaluator run builds it) in `device_monitors.validation_loop`.
    """
    if v is None:
        return lambda state, inputs: None
    carry_step = make_carry_step(v.loop.program, v.loop.metrics, False)
    body = member_chunk(make_chunk_fn(member_carry_step(carry_step), True, False))
    return validation_loop(v, body, lambda: population_tail(v.loop.metrics, False, size))


def _where(mask: Any, new: Any, old: Any) -> Any:
    """Member-wise `new` where `mask`, else `old`."""

    def pick(a: Any, b: Any) -> Any:
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, new, old)


def _buffers(
    segments: int, slots: int, tail: Any, epoch_shapes: Any, record: bool
) -> dict[str, Any]:
    """The dispatch's per-segment output buffers, zeroed."""

    def per_segment(a: Any) -> Any:
        return jnp.zeros((segments,) + a.shape, a.dtype)

    size = tail["active"].shape
    out = {
        **jax.tree.map(per_segment, epoch_shapes),
        "final": jax.tree.map(per_segment, tail["acc"]),
        "n_run": jnp.zeros((segments,), jnp.int32),
        "nonfinite": jnp.zeros((segments,) + size, jnp.bool_),
        "active": jnp.zeros((segments,) + size, jnp.bool_),
    }
    return {**out, **record_buffers(segments, slots, tail["acc"], record)}
