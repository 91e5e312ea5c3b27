"""What a fused run over host batches tells of a short last batch, which it cannot stack
with full ones: the fixes that work where it runs (one device, or a mesh the short batch
may not divide over either)."""

from __future__ import annotations

import jax

from ._fusion import FusionError

__all__ = ["short_batch_error"]


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
