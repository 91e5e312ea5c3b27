"""What a fused run over host batches tells of a short last batch, which it cannot stack
with full ones: the fixes that work where it runs (one device, or a mesh the short batch
may not divide over either), said before the epoch's first step where the source shows
its last batch (a list, a tuple, `fl.data.arrays`)."""

from __future__ import annotations

from typing import Any

import jax

from ._fusion import FusionError

__all__ = ["refuse_short_batch", "short_batch_error"]


def short_batch_error(
    n: int, batch_size: int, short: int, devices: int | None = None
) -> FusionError:
    """The refusal of a fused run over host batches whose last one is short (`short` of
    `n` examples): known before the first step, where an `fl.data.arrays` source says so.
    `devices`: the mesh's "data" axis, which the short batch does not divide over either."""
    head = (
        f"data: the last batch holds {short} of the {n} examples, not batch_size="
        f"{batch_size}, and a fused run stacks batches of one shape (it compiles once for it)"
    )
    if devices is None:
        return FusionError(
            f"{head}; use fl.data.arrays(..., device=True), which runs a short last batch as "
            f"a step of its own, fuse=False, or in training data drop_remainder=True "
            f"(padding would count as examples)"
        )
    # Several processes always share one global mesh: mesh=None is that one.
    no_mesh = ", or run without the mesh (mesh=None)," if jax.process_count() == 1 else ""
    return FusionError(
        f"{head}; nor do {short} examples divide over the {devices} devices of the mesh's "
        f"'data' axis. Trim the dataset to a multiple of {devices} examples{no_mesh} and use "
        f"fl.data.arrays(..., device=True), which runs a short last batch as a step of its "
        f"own, or fuse=False; or in training data pass drop_remainder=True (the short "
        f"batch is left out)"
    )


def refuse_short_batch(
    data: Any,
    placement: Any,
    checker: Any,
    reaches_end: bool,
    epoch: int,
    live: bool,
    may_halt: bool,
) -> None:
    """Refuses, as an epoch begins, a short last batch that a fused chunk cannot stack, and
    one a mesh cannot divide, rather than after the steps before it: an `fl.data.arrays`
    source's, or the last batch of a list or tuple that only a shorter batch axis sets
    apart (`Checker.refuse_short`). `reaches_end`: the epoch steps its last batch unless
    it halts first; `live`: an unfused run, which takes a short batch as a step of its
    own; `may_halt`: an iteration handler or the guard may halt the epoch before its last
    batch, which a list's is then refused at, only if it comes (as the unfused loop)."""
    if not reaches_end:
        return
    if isinstance(data, (list, tuple)):
        if not (live or may_halt) and len(data) > 1:
            checker.refuse_short(data, epoch)
        return
    short = getattr(data, "short_batch", 0)
    if not short:
        return
    if not live and data.n > data.batch_size:
        over = placement.indivisible(short)  # its fixes must work on the mesh too
        raise short_batch_error(data.n, data.batch_size, short, over)
    placement.chunk_sharding(short, short=True)
