"""What `fl.predict` asks of a model's outputs: one row per example, first, in every leaf,
whatever the batch's size (checked when the chunk program is traced), and batches whose
outputs can be joined into one array per leaf."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._metrics import batch_size

__all__ = ["LIST_READ", "joined", "require_rows", "require_rows_follow"]

LIST_READ = (
    "A list passed as x is read as a list of batches: for a model of several inputs pass "
    "them as a tuple (a, b) or a dict of arrays; for a list of single examples, stack "
    "them: np.stack(examples)"
)


def require_rows(out: Any, examples: int, listed: bool = False) -> None:
    """Raises a ValueError unless every output leaf has one row per example of its batch
    (checked when the program is traced); `listed`: x was a list (maybe of inputs)."""
    paths = jax.tree_util.tree_flatten_with_path(out)[0]
    for path, leaf in paths:
        shape = tuple(np.shape(leaf))
        if not shape or shape[0] != examples:
            where = f"output{jax.tree_util.keystr(path)}"  # "output" for a single array
            hint = (
                LIST_READ
                if listed
                else "If x is one example, add the batch's axis: x[None]. Otherwise, "
                "predict returns one row per example: have the model return only "
                "per-example outputs (e.g. wrap it to leave out a per-batch value), or "
                "call model.apply yourself for other outputs"
            )
            raise ValueError(
                f"x: the model's {where} for a batch of {examples} examples has shape "
                f"{shape}, not one row per example, so predict cannot return one per "
                f"example. {hint}"
            )


def require_rows_follow(adapter: Any, variables: Any, x: Any, out: Any, listed: bool) -> None:
    """`require_rows` where an output's leading axis only happens to be the batch's size
    (an ensemble's (members, B, C) of 8 members in batches of 8): one example more must
    make one row more (traced only; a model whose trace fails for another batch size is
    not asked, while one that reshapes a fixed batch size out of x is refused)."""

    def grown(leaf: Any) -> Any:
        shape = tuple(np.shape(leaf))
        return jax.ShapeDtypeStruct((shape[0] + 1, *shape[1:]) if shape else shape, leaf.dtype)

    try:
        more = jax.eval_shape(
            lambda v, b: adapter.forward(v, b, train=False, rng=None)[0],
            variables,
            jax.tree.map(grown, x),
        )
    except Exception:  # noqa: BLE001 - a model of one batch size: nothing to compare
        return
    structure: object = jax.tree.structure(out)  # no stub for PyTreeDef: compare as objects
    if jax.tree.structure(more) != structure:
        return
    examples = batch_size(x)
    paths = jax.tree_util.tree_flatten_with_path(out)[0]
    for (path, leaf), other in zip(paths, jax.tree.leaves(more), strict=True):
        if np.shape(other)[:1] == np.shape(leaf)[:1]:
            where = f"output{jax.tree_util.keystr(path)}"  # "output" for a single array
            raise ValueError(
                f"x: the model's {where} has shape {np.shape(leaf)} for a batch of "
                f"{examples} examples and {np.shape(other)} for {examples + 1}: its first "
                f"axis is not the examples' (an ensemble's members?), so predict cannot "
                f"return one row per example. Have the model put the examples first (e.g. "
                f"jnp.moveaxis(out, 0, 1)), or call model.apply yourself"
            )


def joined(outputs: list[Any], lead: int) -> Any:
    """The chunks' outputs joined on the examples' axis; an output whose other axes follow
    the batch's size (in-batch similarities of shape (B, B)) cannot be, and is named."""

    def join(path: Any, *parts: Any) -> Any:
        rest = sorted({np.shape(p)[:lead] + np.shape(p)[lead + 1 :] for p in parts})
        if len(rest) > 1:
            raise ValueError(
                f"x: the model's output{jax.tree_util.keystr(path)} has per-example shapes "
                f"{', '.join(map(str, rest))} in batches of different sizes (an axis that "
                f"follows the batch's size, as in-batch similarities of shape (B, B) do), so "
                f"predict cannot join them into one array. Use batches of one size (a "
                f"batch_size that divides the examples), or call model.apply per batch"
            )
        return np.concatenate(parts, axis=lead)

    return jax.tree_util.tree_map_with_path(join, *outputs)
