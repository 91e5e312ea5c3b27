"""Whether a fresh init reads its first batch's values, and that batch when it does.

A model's init runs its forward pass on x (linen's `init`, most `init_fn(rng, x)`), yet
its parameters are drawn from the key alone: only x's shapes count, and the init program
makes a batch of zeros inside itself, moving nothing. A data-dependent initializer (an
offset set to minus the batch mean, Glow's ActNorm) reads the values, as
`model.init(rng, x)` in a hand-written loop does: its program takes the first batch
itself. Which one a model is, its init's jaxpr tells (docs/design.md §6).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Var

__all__ = ["abstract_batch", "batch_values", "reads_any", "reads_batch"]


def reads_any(jaxpr: Any, inputs: list[Any]) -> bool:
    """Whether any output (or effect) of `jaxpr` depends on one of its `inputs`: a walk back
    from the outputs, an equation needed where any of its outputs is (a nested program as a
    whole: where it is needed, all its inputs are)."""
    needed = {v for v in jaxpr.outvars if isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if isinstance(v, Var))
    return any(v in needed for v in inputs)


def reads_batch(init: Callable[..., Any], leading: tuple[Any, ...], batch: Any) -> bool:
    """Whether `init(*leading, batch)` has a value that depends on one of `batch`'s values
    (`batch`: shapes and dtypes, `abstract_batch`); traced once, nothing is compiled."""
    traced = jax.make_jaxpr(init)(*leading, batch)
    return reads_any(traced.jaxpr, traced.jaxpr.invars[len(jax.tree.leaves(leading)) :])


def abstract_batch(treedef: Any, spec: Any) -> Any:
    """The first batch as shapes and dtypes, from its device signature `(treedef, spec)`."""
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in spec])


def batch_values(first: Any) -> Any:
    """`first` on the device, for an init that reads its values (explicit: the run moves
    the batch again as data). Under several processes each holds only its rows of a
    global batch, and an init from them would differ between processes: refused."""
    if any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        for leaf in jax.tree.leaves(first)
    ):
        raise ValueError(
            "model: its init reads the first batch's values (a data-dependent "
            "initializer, e.g. an offset or a scale set from the batch's statistics), and "
            "under several processes each process holds only its rows of that batch. "
            "Initialise it once, from the same rows in every process, and pass the "
            "variables: run(data, model.init(rng, x))"
        )
    return jax.device_put(first)
