"""Loop fusion: stacking a chunk of batches and the device loop that steps through it.

The device loop is specified by this Python reference loop (the unfused path runs exactly
this, one compiled `carry_step` per batch):

    for i in range(n_valid):                       # n_valid <= K; padded slots never run
        state, tail = carry_step(state, tail, chunk[i])
        records[i] = tail["acc"]                   # only when the host replays iterations
        if guard and tail["nonfinite"]: break

On a CPU it is a `lax.while_loop` whose trip count is a runtime value, compiled once per
(K, shapes), so the padded last chunk reuses it. Elsewhere (a GPU, a TPU) a loop whose
trip count is a runtime value makes the device hand its condition to the host after every
step, which waits for it: a `lax.scan` over all the chunk's slots runs instead, each step
committed only where it is live, and a short chunk has a program of its own size
(docs/design.md §2, "The loop's form on each backend").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._arg_types import is_int
from ._leafless import Leafless, chunk_size, slot_of
from ._metrics import batch_size
from ._unsliceable import unmasked

__all__ = [
    "LOOP_OPTIONS",
    "FusionError",
    "stack_chunk",
    "make_chunk_fn",
    "chunk_slots",
    "static_trip_count",
    "DEFAULT_CHUNK",
    "resolve_fuse",
]

DEFAULT_CHUNK = 32
# Every program with the device loop compiles with XLA's loop-invariant code motion off. It
# lifts out of the step loop what a step computes from constants alone, which comes back as
# a constant at a program's top level but stays an opaque loop input out of a loop nested
# in another (a multi-epoch dispatch): there XLA simplified the step otherwise, an ulp
# apart (docs/design.md §9, "Where one loop body is not enough").
LOOP_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


class FusionError(ValueError):
    """Data that cannot be fused (batches of different shapes or dtypes in one chunk).

    Example:
        >>> issubclass(FusionError, ValueError)
        True
    """


def resolve_fuse(fuse: Any, jit: bool) -> int | str | None:
    """Validates `run(fuse=...)`: returns None (unfused) for False, a chunk size, "auto", or
    "run" (as many epochs per dispatch as the handlers allow, on device-resident data;
    docs/design.md §9).
    """
    if fuse is None:  # not taken for False: §4.8 refuses non-int values
        raise ValueError(
            f"fuse=None is not accepted: give fuse=False for the unfused loop; accepted "
            f"values: False, True (chunks of {DEFAULT_CHUNK}), a positive int chunk size, "
            f"'auto', or 'run'"
        )
    if fuse is False:
        return None
    if not jit:
        raise ValueError(
            "fuse requires jit=True: the fused device loop is a compiled program; "
            "use fuse=False to debug op by op with jit=False"
        )
    if fuse is True:
        return DEFAULT_CHUNK
    if fuse == "auto":
        return "auto"
    if fuse == "run":
        return "run"
    if is_int(fuse) and fuse >= 1:
        return int(fuse)
    raise ValueError(
        f"fuse={fuse!r} is not accepted; accepted values: False, True (chunks of "
        f"{DEFAULT_CHUNK}), a positive int chunk size, 'auto', or 'run'"
    )


def _signature(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    array = leaf if hasattr(leaf, "dtype") else np.asarray(leaf)
    return tuple(array.shape), np.dtype(array.dtype)


def stack_chunk(batches: Sequence[Any], size: int, first_index: int) -> Any:
    """Stacks `batches` leaf by leaf along a new leading axis, zero-padded to `size` slots
    (batches holding no arrays: a `Leafless` chunk of `size` slots).

    Raises:
        FusionError: a batch differs in structure, shape or dtype from the chunk's first,
            naming the batch (its iteration in the epoch), the leaf, expected and actual.
    """
    treedef: Any  # this jaxlib has no stub for PyTreeDef
    leaves0, treedef = jax.tree.flatten(batches[0])
    if not leaves0:  # no arrays to stack (a step that makes its own data)
        for slot_index, batch in enumerate(batches):
            _check_structure(batch, treedef, first_index + slot_index)
        return Leafless(size, treedef)
    expected = [_signature(leaf) for leaf in leaves0]
    columns = _columns(batches, treedef, first_index)
    for j, column in enumerate(columns):
        _check_column(column, j, expected[j], first_index)
    out = [_stack_column(c, size, *sig) for c, sig in zip(columns, expected, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _columns(batches: Sequence[Any], treedef: Any, first_index: int) -> list[list[Any]]:
    """The batches' leaves, one list per leaf of the structure `treedef`."""
    if treedef == _PAIR and all(type(batch) is tuple and len(batch) == 2 for batch in batches):
        # The common case, without a pytree walk per batch.
        return [[x for x, _ in batches], [y for _, y in batches]]
    columns: list[list[Any]] = [[] for _ in range(treedef.num_leaves)]
    for slot, batch in enumerate(batches):
        _check_structure(batch, treedef, first_index + slot)
        for column, leaf in zip(columns, treedef.flatten_up_to(batch), strict=True):
            column.append(leaf)
    return columns


def _check_column(column: list[Any], leaf: int, expected: Any, first_index: int) -> None:
    """Every batch's leaf `leaf` has the chunk's first batch's shape and dtype (a leaf that
    is not an array is converted in place)."""
    shape, dtype = expected
    for slot, value in enumerate(column):
        if not hasattr(value, "dtype"):
            column[slot] = value = np.asarray(value)
        if value.shape != shape or value.dtype != dtype:
            _raise_mismatch(first_index + slot, leaf, expected, _signature(value))


def _stack_column(column: list[Any], size: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """One leaf's batches in `size` slots (checked alike), zero-padded."""
    n = len(column)
    if any(type(leaf) is not np.ndarray for leaf in column):  # a masked array loses its mask
        column = [
            unmasked(leaf, f"the leaf of batch {i} of the chunk") for i, leaf in enumerate(column)
        ]
    buffer = np.empty((size,) + shape, dtype)
    if shape:
        # In C order, slot i of the stack holds rows i*len .. (i+1)*len of the batches laid
        # end to end: one concatenation writes them, without a stacked view of each batch
        # (half the time of `np.stack` on a chunk of small batches).
        np.concatenate(column, out=buffer[:n].reshape((n * shape[0],) + shape[1:]))
    else:
        np.stack(column, out=buffer[:n])
    buffer[n:] = 0  # padded slots are never stepped; zeros keep them harmless
    return buffer


_PAIR = jax.tree.structure((0, 0))


def _check_structure(batch: Any, treedef: Any, index: int) -> None:
    other = jax.tree.structure(batch)
    if other != treedef:
        raise FusionError(
            f"batch {index} (iteration {index} of the epoch) has structure {other}, expected "
            f"{treedef} like the chunk's first batch; fused chunks need uniform batches: use "
            f"fuse=False or make them uniform"
        )


def _raise_mismatch(
    index: int, leaf: int, expected: tuple[Any, Any], actual: tuple[Any, Any]
) -> None:
    raise FusionError(
        f"batch {index} (iteration {index} of the epoch), leaf {leaf}: expected shape "
        f"{expected[0]} dtype {expected[1]}, got shape {actual[0]} dtype {actual[1]}; fused "
        f"chunks need uniform batches: use fuse=False, drop_remainder=True, or "
        f"fl.data.arrays(..., device=True) (a short last batch runs as a step of its own)"
    )


def make_chunk_fn(
    carry_step: Callable[[Any, Any, Any], tuple[Any, Any]],
    record: bool,
    guard_nonfinite: bool,
) -> Callable[..., tuple[Any, Any, Any, Any]]:
    """The fused program: `(state, tail, chunk, n_valid) -> (state, tail, records, n_run)`.

    Args:
        carry_step: One step plus metric accumulation (see `_step.make_carry_step`).
        record: Write each iteration's accumulators into a `[K]` buffer for host replay.
        guard_nonfinite: Stop the loop at the first non-finite step, which is not committed:
            `carry_step` commits it (built with `keep_old=False`); the while loop computes
            the chunk's carry before it again from the chunk's start, the scan selects the
            carry before it.
    """

    looped = _looped_chunk_fn(carry_step, record, guard_nonfinite)
    masked = _masked_chunk_fn(carry_step, record, guard_nonfinite)

    def chunk_fn(state: Any, tail: Any, chunk: Any, n_valid: Any) -> tuple[Any, Any, Any, Any]:
        form = masked if static_trip_count() else looped
        try:
            return form(state, tail, chunk, n_valid)
        except TypeError as error:  # the carry changed type: say which leaf, and why
            try:
                changed = _changed_leaves(carry_step, state, tail, slot_of(chunk, 0))
            except Exception as again:  # the step itself fails, traced outside the loop
                if type(again) is type(error):  # the same failure: one copy of its notes
                    again.__suppress_context__ = True
                raise
            if not changed:
                raise
            raise ValueError(_carry_message(changed, batch_size(slot_of(chunk, 0)))) from error

    return chunk_fn


def _looped_chunk_fn(
    carry_step: Callable[[Any, Any, Any], tuple[Any, Any]],
    record: bool,
    guard_nonfinite: bool,
) -> Callable[..., tuple[Any, Any, Any, Any]]:
    """`make_chunk_fn`'s program as a while loop over the live slots (the CPU's form)."""

    def chunk_fn(state: Any, tail: Any, chunk: Any, n_valid: Any) -> tuple[Any, Any, Any, Any]:
        size = chunk_size(chunk)
        records = (
            jax.tree.map(lambda a: jnp.zeros((size,) + a.shape, a.dtype), tail["acc"])
            if record
            else None
        )

        def cond(carry: tuple[Any, ...]) -> Any:
            i, _, tail, _ = carry
            keep_going = i < n_valid
            if guard_nonfinite:
                keep_going = keep_going & ~tail["nonfinite"]
            return keep_going

        def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            i, state, tail, records = carry
            state, tail = carry_step(state, tail, slot_of(chunk, i))
            if record:
                records = jax.tree.map(
                    lambda buf, value: lax.dynamic_update_index_in_dim(buf, value, i, 0),
                    records,
                    tail["acc"],
                )
            return i + 1, state, tail, records

        start = (jnp.zeros((), jnp.int32), state, tail, records)
        n_run, state, tail, records = lax.while_loop(cond, body, start)
        if guard_nonfinite:
            state, tail, records = lax.cond(
                tail["nonfinite"],
                lambda: _undo_last_step(cond, body, start, n_run, record),
                lambda: (state, tail, records),
            )
        return state, tail, records, n_run

    return chunk_fn


_LOOP_FORM_VAR = "FUSELOOP_DEVICE_LOOP"


def static_trip_count() -> bool:
    """Whether the device loop being traced runs all K slots (`lax.scan`, a step committed
    only where it is live) rather than stopping after the live ones (`lax.while_loop`).

    The scan off a CPU, the while loop on one: a GPU's while loop with a runtime trip count
    copies its condition to the host after each step and waits for it (about twice the time
    of a small model's step), while on a CPU the condition is already on the host and the
    padded slots of a short chunk cost nothing. `FUSELOOP_DEVICE_LOOP=scan` or `=while`
    chooses one form everywhere (the tests run the scan's on a CPU that way).
    """
    form = os.environ.get(_LOOP_FORM_VAR, "")
    if form in ("scan", "while"):
        return form == "scan"
    return jax.default_backend() != "cpu"


def chunk_slots(size: int, n: int) -> int:
    """The slots of a chunk of `n` live steps in a run of chunks of `size`: `size` where the
    loop stops after the live steps, `n` where it runs every slot (a short last chunk then
    compiles a program of its own rather than stepping `size - n` slots for nothing).

    Example:
        >>> chunk_slots(32, 32)
        32
    """
    return n if n < size and static_trip_count() else size


def _masked_chunk_fn(
    carry_step: Callable[[Any, Any, Any], tuple[Any, Any]],
    record: bool,
    guard_nonfinite: bool,
) -> Callable[..., tuple[Any, Any, Any, Any]]:
    """`make_chunk_fn`'s program as a scan over every slot: a slot's step is committed
    where it is live (before `n_valid`, and with the guard, before a non-finite step), the
    carry is kept as it was elsewhere. The non-finite step itself is not committed, so
    nothing has to be computed again; `n_run` counts it, as the while loop's does, and its
    record is the accumulators before it."""

    def chunk_fn(state: Any, tail: Any, chunk: Any, n_valid: Any) -> tuple[Any, Any, Any, Any]:
        size = chunk_size(chunk)

        def body(carry: tuple[Any, Any], i: Any) -> tuple[tuple[Any, Any], Any]:
            state, tail = carry
            live = i < n_valid
            if guard_nonfinite:
                live = live & ~tail["nonfinite"]
            new_state, new_tail = carry_step(state, tail, slot_of(chunk, i))
            commit = live & ~new_tail["nonfinite"] if guard_nonfinite else live
            keep = lambda new, old: lax.select(commit, new, old)  # noqa: E731
            state = jax.tree.map(keep, new_state, state)
            # The whole tail, as the while loop takes it: a population's per-member guard
            # flags are in it beside the accumulators.
            kept = jax.tree.map(keep, new_tail, tail)
            if guard_nonfinite:  # the flag stays set, though its step is not committed
                kept["nonfinite"] = tail["nonfinite"] | (live & new_tail["nonfinite"])
            written = None
            if record:  # zeros past the live steps, as the while loop leaves its buffer
                written = jax.tree.map(lambda a: jnp.where(live, a, jnp.zeros_like(a)), kept["acc"])
            return (state, kept), (written, live)

        (state, tail), (records, lives) = lax.scan(body, (state, tail), jnp.arange(size))
        return state, tail, records, jnp.sum(lives, dtype=jnp.int32)

    return chunk_fn


def _changed_leaves(carry_step: Any, state: Any, tail: Any, batch: Any) -> list[str]:
    """The step state's leaves whose shape or dtype one step changes, as 'path: in -> out'."""
    out_state, _ = jax.eval_shape(carry_step, state, tail, batch)
    before = jax.tree_util.tree_flatten_with_path(state)[0]
    after = jax.tree_util.tree_flatten_with_path(out_state)[0]
    if [p for p, _ in before] != [p for p, _ in after]:
        from ._step_state_check import structure_change  # it imports the step builders

        return [structure_change(before, after)]
    return [
        f"{jax.tree_util.keystr(path)}: {_spec(old)} -> {_spec(new)}"
        for (path, old), (_, new) in zip(before, after, strict=True)
        if (jnp.shape(old), jnp.result_type(old)) != (new.shape, new.dtype)
    ]


def _spec(leaf: Any) -> str:
    return f"{jnp.result_type(leaf).name}{list(jnp.shape(leaf))}"


def _carry_message(changed: list[str], batch: int) -> str:
    return (
        f"the step changed its step state's leaves (on a batch of {batch} examples): "
        f"{'; '.join(changed[:3])}. "
        f"Every leaf of the step state must keep its shape and dtype from step to step. A "
        f"leaf sized by the batch (such as y_pred) needs batches of one size: pass "
        f"drop_remainder=True (or uniform batches), or keep per-batch values out of the "
        f"step state; a dtype change needs the step to cast back (e.g. .astype). A step "
        f"state that a handler returned (state.replace(step_state=...)) must keep the "
        f"structure the step returns"
    )


def _undo_last_step(
    cond: Callable[..., Any], body: Callable[..., Any], start: Any, n_run: Any, record: bool
) -> tuple[Any, Any, Any]:
    """The chunk's carry before its last step, which was not finite: the same loop body
    run again from the chunk's start for the steps before it (a deterministic program gives
    the same bits), then the flag set and the bad iteration's record made the accumulators
    before it. Runs only in a chunk that met a non-finite step (docs/design.md §2).
    """
    good = n_run - 1
    _, state, tail, records = lax.while_loop(
        lambda carry: cond(carry) & (carry[0] < good), body, start
    )
    if record:
        records = jax.tree.map(
            lambda buf, value: lax.dynamic_update_index_in_dim(buf, value, good, 0),
            records,
            tail["acc"],
        )
    return state, {**tail, "nonfinite": jnp.ones((), jnp.bool_)}, records
