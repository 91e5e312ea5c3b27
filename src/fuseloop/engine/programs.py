"""The loop's compiled programs, in a typed cache kept on the Loop (no recompiles).

Every step a jitted run takes, fused or not, runs inside one and the same device loop
(`_fusion.make_chunk_fn`), built only here. The unfused step hands it `MIN_SLOTS` slots with
one live batch; chunks are padded to K; records are always written. Why that makes fused
and unfused runs bitwise equal is in docs/design.md §2 ("one loop body for every K").
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from .._epoch_order import EpochOrder, prng_config
from .._fusion import LOOP_OPTIONS, make_chunk_fn
from .._leafless import widened
from .._placement import default_device_key, device_key
from .._shards import take_rows
from .._step import make_carry_step
from .._sums import accumulator_dtype
from . import conv_layout, shared_programs
from .packing import copying, pack_leaves
from .population import masked_step, member_carry_step, member_chunk

__all__ = ["ProgramCache", "Programs", "MIN_SLOTS", "kept_order"]

MIN_SLOTS = 2
_SPARE_LOCK = threading.Lock()
# A resident source's epoch orders on the device, by source (dropped with it), a few epochs
# each (`kept_order`); its first batches too (`resident_start.first_resident_batch`).
_ORDERS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
KEPT_EPOCHS = 4


@dataclass(eq=False)
class ProgramCache:
    """Compiled programs and measurements of one Loop, one named field per kind.

    Loops that differ only in their handlers share one cache (handlers change no program);
    any other change starts a fresh one. The epoch order, first batch, fresh tail, pack
    and unpack programs depend on no Loop: every Loop names the same (`shared_programs`).

    Attributes:
        traces: How many times a program of the loop was traced (each trace is a compile).
        chunk: The host-fed chunk program, by whether it copies its carry (`Programs`).
        unfused: One live step on a host batch.
        resident: Resident chunk programs by `(slots, live, rows, sharding, copies)`.
        epoch_order: Resident epoch-order programs by the order's layout (size, batch size,
            shuffle, drop_remainder); the seed's key is their input.
        first_batch: Resident first-batch programs by the short batch's size and sharding.
        fresh_tail: Builds zeroed metric accumulators; `spare_tail`, `(default device,
            accumulators)` made ahead for the next epoch start (a value, taken once).
        init: The trainer's jitted initialization by first-batch signature.
        verdicts: Model-fit checks already passed, by the shapes checked (`_checks.Checker`).
        probe: `fuse="auto"` probe timings `(step_s, overhead_s)` by batch signature and mesh.
        pack: Packs a carry into one buffer per dtype (the snapshot before a launch ahead).
        unpack: Unpacks such a snapshot, by the carry's structure, shapes and dtypes.
        populations: The programs of population runs (a member axis), one cache per size.
        whole_run: Multi-epoch resident programs (`whole_run.py`), by their static shape.
        prng: The PRNG configuration the programs were traced under (`prng_config()`:
            the kind, whether threefry is partitionable): a raw key means another
            generator under another kind, which jax's caches do not tell apart, so a
            change starts the cache afresh; as does one of `metrics_dtype`, the
            accumulators' dtype (`accumulator_dtype()`: float64 under x64).
        model_seen: A plain model object as these programs' last trace left it
            (`from_functions.snapshot`); a change since refuses the next run.
        evaluations: The evaluator Loops `Loop.validate` built, by model and metrics.
    """

    traces: int = 0
    chunk: dict[bool, Any] = field(default_factory=dict)
    unfused: Any = None
    resident: dict[Any, Any] = field(default_factory=dict)
    epoch_order: dict[Any, Any] = field(default_factory=dict)
    first_batch: dict[Any, Any] = field(default_factory=dict)
    fresh_tail: Any = None
    spare_tail: Any = None
    init: dict[Any, Any] = field(default_factory=dict)
    verdicts: dict[Any, Any] = field(default_factory=dict)
    probe: dict[Any, Any] = field(default_factory=dict)
    pack: Any = None
    unpack: dict[Any, Any] = field(default_factory=dict)
    populations: dict[int, Any] = field(default_factory=dict)  # member count -> its cache
    whole_run: dict[Any, Any] = field(default_factory=dict)
    prng: tuple[str, bool] = field(default_factory=prng_config)
    metrics_dtype: Any = field(default_factory=accumulator_dtype)
    model_seen: Any = None
    evaluations: dict[Any, Any] = field(default_factory=dict)

    def for_current_prng(self) -> ProgramCache:
        """This cache, emptied of programs (not of its trace count) if the PRNG
        configuration or the metrics' dtype in force is not the one they were made under."""
        if self.prng != prng_config() or self.metrics_dtype != accumulator_dtype():
            self.empty()
        return self

    def empty(self) -> None:
        """Lets go of every program (emptied in place: a Loop keeps it), not the trace count."""
        self.__dict__.update(ProgramCache(traces=self.traces).__dict__)


class Programs:
    """Builds a Loop's programs on first use, into the Loop's `ProgramCache`.

    `copies`: the chunk programs (host-fed and resident) also return a packed copy of the
    carry they end with, last, for a run that launches chunks ahead of replays that may
    halt (iteration handlers): the copy is the snapshot to roll back to, made on the
    device inside the chunk instead of by a dispatch of its own (`Carry.snapshot`;
    docs/design.md §6). Only a carry of at most `COPY_BYTES` is copied; a larger one gets
    None there and is packed when a snapshot is needed.
    """

    COPY_BYTES = 256 * 1024

    def __init__(self, loop: Any, population: Any = None, copies: bool = False):
        self.loop, self.cache = loop, loop._programs.for_current_prng()
        self.guard = loop.guard_nonfinite
        self.population = population  # a population run: programs vmapped over members
        self.copies = copies
        if population is not None:
            self.cache = self.cache.populations.setdefault(population.size, ProgramCache())

    @property
    def traces(self) -> int:
        """This cache's traces and those of the loop's validation evaluators (its compiles)."""
        handlers = [r.handler for r in self.loop.registrations]  # validate's: its evaluator
        nested = {h.loop._programs for h in handlers if getattr(h, "on_device", 0) == "validate"}
        nested |= {p for c in nested for p in c.populations.values()}
        return self.cache.traces + sum(c.traces for c in nested)

    def check_model(self) -> None:
        """Refuses a model changed since these programs traced it (an nnx module's
        structure, a plain object's attributes), before anything traces it again. An
        evaluator takes a changed plain object as it is (its programs traced anew), as
        `fl.predict` does: a validation inside a new trainer loop follows that loop."""
        model = self.loop.program.model
        structure = getattr(model, "check_structure", None)
        if structure is not None:
            structure()
        unchanged = getattr(model, "check_unchanged", None)
        if unchanged is None:
            return
        try:
            unchanged(self.cache.model_seen)
        except ValueError:
            if self.loop.program.kind != "evaluator":
                raise
            self.cache.empty()

    def counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, counting its traces in the cache (each trace is a compile). A plain model
        object is checked to be as the cache's last trace left it, and noted as this
        trace leaves it (what its own apply sets while traced, a counter, is its own)."""
        cache, model = self.cache, self.loop.program.model
        unchanged = getattr(model, "check_unchanged", None)

        def traced(*args: Any) -> Any:
            cache.traces += 1  # runs at trace time only
            if unchanged is None:
                return fn(*args)
            unchanged(cache.model_seen)  # changed by a handler since an earlier trace?
            out = fn(*args)
            cache.model_seen = model.snapshot()
            return out

        # Named as fuseloop's: its convolutions lower channel-last on CPU (conv_layout.py).
        return conv_layout.named(traced, getattr(fn, "__name__", "program").strip("_<>"))

    def _jit(self, fn: Callable[..., Any], copies: bool = False) -> Any:
        donate = (0, 1) if self.loop.program.donate_state else (1,)
        if copies:
            fn = copying(fn, self.COPY_BYTES)
        return jax.jit(self.counted(fn), donate_argnums=donate, compiler_options=LOOP_OPTIONS)

    def _device_loop(self, fetch: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
        """The one device loop every program runs (records always on: the body must not
        change with what the host needs).

        `fetch` (None: the chunk holds the batches) maps each slot of the chunk to its
        batch inside the loop: a resident program hands the loop row indices and each step
        gathers its own batch (no gathered copy of the chunk).
        """
        # A solo loop undoes a non-finite step once, at the chunk's end (_fusion.py); a
        # population's guard freezes each member at its own bad step.
        solo = self.population is None
        carry_step = make_carry_step(
            self.loop.program, self.loop.metrics, self.guard, keep_old=not solo
        )
        if not solo:
            carry_step = member_carry_step(carry_step)
        if fetch is not None:
            carry_step = _fetching(carry_step, fetch)
        if self.population is None:
            return make_chunk_fn(carry_step, True, self.guard)
        # A population's guard acts per member (it freezes the member), so the loop
        # itself does not stop at a non-finite step.
        return member_chunk(make_chunk_fn(carry_step, True, False))

    def resident_loop(self, data: Any, sharding: Any = None) -> Callable[..., Any]:
        """The device loop over a device-resident dataset, built inside a program's trace:
        `(state, tail, rows, n_valid) -> (state, tail, records, n_run)`, where `rows`
        (int32[slots, batch]) are the examples of each slot.

        Without a mesh each step gathers its own batch (gathering the whole chunk first
        costs a copy of it); with `sharding` (the rows split over the mesh) the chunk is
        gathered at once, bit-exactly (`_shards.take_rows`), and placed by `sharding`, so
        the collectives run once per chunk, not once per step.
        """
        if sharding is None:
            return self._device_loop(lambda rows: jax.tree.map(lambda leaf: leaf[rows], data))
        body = self._device_loop()

        def gathered(state: Any, tail: Any, rows: Any, n_valid: Any) -> tuple[Any, ...]:
            chunk = jax.tree.map(lambda leaf: take_rows(leaf, rows), data)
            chunk = jax.lax.with_sharding_constraint(chunk, sharding)
            return body(state, tail, chunk, n_valid)

        return gathered

    def eager_step(self) -> Any:
        """`jit=False`: one step, op by op, for debugging."""
        carry_step = make_carry_step(self.loop.program, self.loop.metrics, self.guard)
        return carry_step if self.population is None else masked_step(carry_step)

    def chunk(self) -> Any:
        """`(state, tail, stacked_chunk, n_valid) -> (state, tail, records, n_run)`, and
        the carry's copy last where `copies`."""
        if self.copies not in self.cache.chunk:
            self.cache.chunk[self.copies] = self._jit(self._device_loop(), self.copies)
        return self.cache.chunk[self.copies]

    def unfused(self) -> Any:
        """`(state, tail, batch, n_valid) -> (state, tail, packed records)`: one step
        through the loop.

        The batch is widened to `MIN_SLOTS` slots on the device, so the host moves it once,
        as it is. `n_valid` (always 1) is a runtime value, so XLA cannot see a one-trip loop
        and simplify it away. The records come out too, never read: XLA would drop unused
        ones with their writes and fuse the loop otherwise (`whole_program.write_segment`).
        """
        if self.cache.unfused is None:
            body = self._device_loop()

            def program(state: Any, tail: Any, batch: Any, n_valid: Any) -> tuple[Any, ...]:
                chunk = widened(batch, MIN_SLOTS)
                state, tail, records, _ = body(state, tail, chunk, n_valid)
                return state, tail, pack_leaves(records)  # a buffer per dtype, not a leaf each

            self.cache.unfused = self._jit(program)
        return self.cache.unfused

    def resident(self, slots: int, live: int, rows: int | None, sharding: Any = None) -> Any:
        """The chunk program over a device-resident dataset.

        `(state, tail, data, order, cursor, limit) -> (state, tail, records, n_run, cursor)`:
        the chunk's examples are gathered on the device by `order` (int32[batches, batch])
        from batch `cursor` on, then stepped by the same loop as a host-fed chunk; at most
        `live` of the `slots` slots run. `rows` (not None) gathers a short batch of that
        many examples instead (the epoch's last batch with `drop_remainder=False`).
        `sharding` (over a mesh) is imposed on the gathered chunk. Where `copies`, the
        carry's copy comes last.
        """
        key = (slots, live, rows, sharding, self.copies)
        if key not in self.cache.resident:
            # `limit` (where the epoch ends: `iterations=` may end it early) is a device
            # scalar, not a constant: a run with another bound reuses the program.
            self.cache.resident[key] = self._jit(
                _resident_program(self, slots, live, rows, sharding), self.copies
            )
        return self.cache.resident[key]

    def epoch_order(self, source: Any) -> Any:
        """`epoch -> (order, epoch + 1, cursor 0)` for a resident source, on the device.
        The program is compiled per order layout; the seed's key is its input.
        """
        spec = _source_key(source)
        layout, seed_key = spec.layout, device_key(spec.key())
        if layout not in self.cache.epoch_order:
            program = shared_programs.epoch_order(layout, self.cache.prng)
            self.cache.epoch_order[layout] = program
        program = self.cache.epoch_order[layout]
        return lambda epoch: program(epoch, seed_key)

    def first_batch(self, source: Any, replicated: Any = None) -> Any:
        """`(data, order) -> batch`: the first batch of an epoch of a resident source, from
        that epoch's device order (`kept_order`: the order the feed then steps on, so the
        epoch's permutation is compiled and computed once).

        `replicated` (over a mesh, where the dataset is split over the devices) is the
        batch's sharding: whole on every device, so every process can read it.
        """
        short = source.n if source.n < source.batch_size else None  # the only batch is short
        key = (short, replicated)
        if key not in self.cache.first_batch:
            self.cache.first_batch[key] = shared_programs.first_batch(*key)
        return self.cache.first_batch[key]

    def pack(self, carry: Any) -> Any:
        """A device copy of `carry` packed into one buffer per dtype (on a CPU, a copy of
        many small arrays costs a dispatch per array; a pack costs one).
        """
        if self.cache.pack is None:
            self.cache.pack = shared_programs.pack()
        return self.cache.pack(carry)

    def unpack(self, packed: Any, like: Any) -> Any:
        """The carry `packed` holds, shaped like `like` (a carry of the same structure)."""
        leaves, treedef = jax.tree.flatten(like)
        spec = tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) for a in leaves)
        layout = (treedef, spec)
        if layout not in self.cache.unpack:
            self.cache.unpack[layout] = shared_programs.unpack(*layout)
        return self.cache.unpack[layout](packed)

    def fresh_tail(self) -> Any:
        """Zeroed metric accumulators (and guard flag), made by one cached program."""
        if self.cache.fresh_tail is None:
            names = tuple(m.name for m in self.loop.metrics)
            members = None if self.population is None else self.population.size
            self.cache.fresh_tail = shared_programs.fresh_tail(names, self.guard, members)
        return self.cache.fresh_tail()

    def epoch_tail(self) -> tuple[Any, Callable[[], None]]:
        """As `fresh_tail`, taking the spare made while the host last waited for the device
        (then an epoch's start dispatches nothing), and what makes the next spare, for the
        carry to call once a program is launched (docs/design.md §6).
        """
        with _SPARE_LOCK:  # runs of one Loop in two threads: a spare goes to one of them
            spare, self.cache.spare_tail = self.cache.spare_tail, None
        if spare is not None and spare[0] == default_device_key():
            return spare[1], self._make_spare_tail
        return self.fresh_tail(), self._make_spare_tail

    def _make_spare_tail(self) -> None:
        if self.cache.spare_tail is None:
            made = (default_device_key(), self.fresh_tail())
            with _SPARE_LOCK:
                self.cache.spare_tail = made


def kept_order(source: Any, epoch: int, compute: Callable[[], Any]) -> Any:
    """The device order of `epoch` of a resident `source`, kept beside the source (dropped
    with it; a few epochs each). It depends on the source and the epoch alone, and no
    program donates it, so later runs over the same data, as training or validation data,
    reuse it (docs/design.md §6).
    """
    kept = _ORDERS.setdefault(source, {})
    key = (_source_key(source), epoch, default_device_key(), prng_config())
    if key not in kept:
        keep_recent(kept, key, compute())
    return kept[key]


def keep_recent(kept: dict[Any, Any], key: Any, value: Any) -> None:
    """`kept[key] = value`, the oldest entry let go past `KEPT_EPOCHS`: what is kept per
    epoch beside a resident source (its orders, its first batches) stays a few epochs'
    worth when a run is resumed epoch after epoch."""
    if len(kept) >= KEPT_EPOCHS:
        kept.pop(next(iter(kept)))
    kept[key] = value


def _source_key(source: Any) -> EpochOrder:
    """What a resident source's order programs depend on (no arrays: a program closing
    over it keeps no dataset alive)."""
    spec: EpochOrder = source.order_spec
    return spec


def _resident_program(
    programs: Programs, slots: int, live: int, rows: int | None, sharding: Any
) -> Callable[..., Any]:
    def program(
        state: Any, tail: Any, data: Any, order: Any, cursor: Any, limit: Any
    ) -> tuple[Any, ...]:
        # Slots past the epoch's end take clamped (valid) rows; they are never stepped.
        batches = order[jnp.minimum(cursor + jnp.arange(slots), order.shape[0] - 1)]
        if rows is not None:
            batches = batches[:, :rows]
        n_valid = jnp.minimum(live, limit - cursor)
        body = programs.resident_loop(data, sharding)
        state, tail, records, n_run = body(state, tail, batches, n_valid)
        return state, tail, records, n_run, cursor + n_run

    return program


def _fetching(carry_step: Any, fetch: Callable[[Any], Any]) -> Callable[..., Any]:
    """`carry_step` on the batch `fetch` makes of each slot's item (its rows)."""

    def step(state: Any, tail: Any, item: Any) -> tuple[Any, Any]:
        return carry_step(state, tail, fetch(item))

    return step
