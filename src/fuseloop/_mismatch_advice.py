"""What to do about a later batch's leaf unlike the run's first batch's (`_checks.Checker`
finds it): the fix depends on what differs (the dtype, the batch axis, another axis), on
whether the unfused loop would take it, and on the kind of batch (a padded graph batch is
padded again, not shortened)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["mismatch_fix"]


def mismatch_fix(
    expected: tuple[Any, Any],
    actual: tuple[Any, Any],
    unfused_takes_it: bool,
    kind: str,
    graph: Any,
) -> str:
    """The fix for a leaf of `actual` (shape, dtype) where `expected` was; `unfused_takes_it`:
    a fused run refused what the unfused loop takes (float64 for float32, a short batch
    axis); `kind`: the program's ("evaluator" keeps every example); `graph`: the run's
    batches are padded graph batches."""
    if expected[0] == actual[0]:  # the dtype alone differs
        if _narrows(actual[1], expected[1]):  # a first batch's `1` made the leaf int32
            return (
                f"the run's first batch gave it as an integer (a Python 1 becomes int32) and "
                f"this one as a {actual[1]}: a cast to {expected[1]} would cut its fraction "
                f"off. Give it as a float in every batch (1.0, or .astype('{actual[1]}'))"
            )
        fix = f"cast it to {expected[1]} where the batches are made (.astype('{expected[1]}'))"
        if isinstance(actual[1], np.dtype) and actual[1] in (np.int64, np.uint64):
            fix += ", where values beyond its range would wrap: map them into range first"
        if unfused_takes_it:
            fix += "; fused chunks stack one dtype per leaf (fuse=False converts)"
        return fix
    if unfused_takes_it and graph is True:
        return (
            "fused chunks compile once for one batch shape: pad every graph batch to the "
            "run's budget of nodes and edges (as jraph.pad_with_graphs takes; the padding "
            "masked in the loss and metrics), or use fuse=False, which takes one batch "
            "padded otherwise"
        )
    if unfused_takes_it:
        dropping = (
            ""
            if kind == "evaluator"
            else ", or leave it out (drop_remainder=True; a torch DataLoader's drop_last=True)"
        )
        return (
            "fused chunks compile once for one batch shape: use fuse=False, or "
            "fl.data.arrays(..., device=True), which runs a short last batch as a step "
            f"of its own{dropping}; padding it would count the padding as examples"
        )
    return (
        "every batch must have the shapes and dtypes of the run's first batch, fused or "
        "not (only the batch axis of a ragged last batch may differ); make the batches "
        "uniform: pad sequences to one length (padding='max_length', masked in the "
        "loss), or reshape or cast them"
    )


def _narrows(actual: Any, expected: Any) -> bool:
    """Whether a cast from `actual` to `expected` drops a fraction (a float to an int)."""
    try:  # jnp's: bfloat16 is a float there; a bool keeps no fraction either
        whole = jnp.issubdtype(expected, jnp.integer) or jnp.issubdtype(expected, jnp.bool_)
        return bool(jnp.issubdtype(actual, jnp.inexact) and whole)
    except TypeError:  # a dtype jax does not know: not a number cast
        return False
