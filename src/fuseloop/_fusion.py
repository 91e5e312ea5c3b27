"""Loop fusion: stacking a chunk of batches and the device loop that steps through it.

The device loop is specified by this Python reference loop (the unfused path runs exactly
this, one compiled `carry_step` per batch):

    for i in range(n_valid):                       # n_valid <= K; padded slots never run
        state, tail = carry_step(state, tail, chunk[i])
        records[i] = tail["acc"]                   # only when the host replays iterations
        if guard and tail["nonfinite"]: break

It is compiled once per (K, shapes) as a `lax.while_loop` whose trip count is a runtime
value, so the program does not grow with K and the padded last chunk reuses it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["FusionError", "stack_chunk", "make_chunk_fn", "DEFAULT_CHUNK", "resolve_fuse"]

DEFAULT_CHUNK = 32


class FusionError(ValueError):
    """Data that cannot be fused (batches of different shapes or dtypes in one chunk).

    Example:
        >>> issubclass(FusionError, ValueError)
        True
    """


def resolve_fuse(fuse: Any, jit: bool) -> int | str | None:
    """Validates `run(fuse=...)`: None (unfused), a chunk size, or "auto"."""
    if fuse is False or fuse is None:
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
    if isinstance(fuse, (int, np.integer)) and not isinstance(fuse, bool) and fuse >= 1:
        return int(fuse)
    raise ValueError(
        f"fuse={fuse!r} is not accepted; accepted values: False, True (chunks of "
        f"{DEFAULT_CHUNK}), a positive int chunk size, or 'auto'"
    )


def _signature(leaf: Any) -> tuple[tuple[int, ...], str]:
    array = np.asarray(leaf) if not hasattr(leaf, "shape") else leaf
    return tuple(array.shape), str(array.dtype)


def stack_chunk(batches: Sequence[Any], size: int, first_index: int) -> Any:
    """Stacks `batches` leaf by leaf along a new leading axis, zero-padded to `size` slots.

    Raises:
        FusionError: a batch differs in structure, shape or dtype from the chunk's first,
            naming the batch (its iteration in the epoch), the leaf, expected and actual.
    """
    leaves0, treedef = jax.tree.flatten(batches[0])
    expected = [_signature(leaf) for leaf in leaves0]
    columns: list[list[Any]] = [[leaf] for leaf in leaves0]
    for offset, batch in enumerate(batches[1:], start=1):
        leaves, other = jax.tree.flatten(batch)
        where = f"batch {first_index + offset} (iteration {first_index + offset} of the epoch)"
        if other != treedef:
            raise FusionError(
                f"{where} has structure {other}, expected {treedef} like the chunk's first "
                f"batch; fused chunks need uniform batches: use fuse=False or make them uniform"
            )
        for j, leaf in enumerate(leaves):
            actual = _signature(leaf)
            if actual != expected[j]:
                raise FusionError(
                    f"{where}, leaf {j}: expected shape {expected[j][0]} dtype {expected[j][1]}, "
                    f"got shape {actual[0]} dtype {actual[1]}; fused chunks need uniform "
                    f"batches: use fuse=False, drop_remainder=True, or pad your batches"
                )
            columns[j].append(leaf)
    stacked = []
    for column, (shape, dtype) in zip(columns, expected):
        out = np.zeros((size,) + shape, dtype=dtype)
        for slot, leaf in enumerate(column):
            out[slot] = np.asarray(leaf)
        stacked.append(out)
    return jax.tree.unflatten(treedef, stacked)


def _index(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def make_chunk_fn(
    carry_step: Callable[[Any, Any, Any], tuple[Any, Any]],
    record: bool,
    guard_nonfinite: bool,
    fetch: Callable[[Any, Any], Any] = _index,
) -> Callable[..., tuple[Any, Any, Any, Any]]:
    """The fused program: `(state, tail, chunk, n_valid) -> (state, tail, records, n_run)`.

    Args:
        carry_step: One step plus metric accumulation (see `_step.make_carry_step`).
        record: Write each iteration's accumulators into a `[K]` buffer for host replay.
        guard_nonfinite: Stop the loop at the first non-finite step (which is not committed).
        fetch: `(chunk, i) -> batch`; the default indexes a stacked chunk, a device-resident
            source gathers by index instead.
    """

    def chunk_fn(state: Any, tail: Any, chunk: Any, n_valid: Any) -> tuple[Any, Any, Any, Any]:
        slots = jax.tree.leaves(chunk)[0].shape[0]
        records = (
            jax.tree.map(lambda a: jnp.zeros((slots,) + a.shape, a.dtype), tail["acc"])
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
            state, tail = carry_step(state, tail, fetch(chunk, i))
            if record:
                records = jax.tree.map(
                    lambda buf, value: lax.dynamic_update_index_in_dim(buf, value, i, 0),
                    records,
                    tail["acc"],
                )
            return i + 1, state, tail, records

        n_run, state, tail, records = lax.while_loop(
            cond, body, (jnp.zeros((), jnp.int32), state, tail, records)
        )
        return state, tail, records, n_run

    return chunk_fn
