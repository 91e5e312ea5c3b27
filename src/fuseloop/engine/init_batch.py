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
import jax.numpy as jnp
from jax.extend.core import Var

from .._distributed import process_count

__all__ = ["abstract_batch", "batch_values", "reads_any", "reads_batch", "zeros_batch"]


def reads_any(jaxpr: Any, inputs: list[Any]) -> bool:
    """Whether any output (or effect) of `jaxpr` depends on one of its `inputs`: a walk back
    from the outputs (`_needed_inputs`)."""
    needed = _needed_inputs(jaxpr, [True] * len(jaxpr.outvars))
    chosen = set(inputs)
    return any(n for v, n in zip(jaxpr.invars, needed, strict=True) if v in chosen)


_DEBUG = frozenset({"debug_print", "debug_callback"})  # effects that feed no value


def _needed_inputs(jaxpr: Any, wanted: list[bool]) -> list[bool]:
    """Which inputs of `jaxpr` the `wanted` outputs depend on: an equation is needed where
    one of its outputs is, or where it has an effect that may feed a value (a ref's write, a
    host callback keeping state; not `jax.debug.print`'s); a nested program (jit, remat, a
    custom derivative, scan: nn.scan's layers, cond: nn.cond's branches) is walked
    through, any other counts as a whole."""
    needed = {v for v, w in zip(jaxpr.outvars, wanted, strict=True) if w and isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        outs = [isinstance(v, Var) and v in needed for v in eqn.outvars]
        if eqn.effects and eqn.primitive.name not in _DEBUG:
            needed.update(v for v in eqn.invars if isinstance(v, Var))
        elif any(outs):
            ins = _equation_inputs(eqn, outs)
            needed.update(
                v for v, n in zip(eqn.invars, ins, strict=True) if n and isinstance(v, Var)
            )
    return [isinstance(v, Var) and v in needed for v in jaxpr.invars]


def _equation_inputs(eqn: Any, outs: list[bool]) -> list[bool]:
    if eqn.primitive.name == "cond":  # the index, then each branch's operands
        branches = [_needed_inputs(b.jaxpr, outs) for b in eqn.params["branches"]]
        return [True] + [any(column) for column in zip(*branches, strict=True)]
    inner = _inner_jaxpr(eqn)
    if inner is None:
        return [True] * len(eqn.invars)
    if eqn.primitive.name != "scan":
        return _needed_inputs(inner, outs)
    # A scan's carry feeds itself: a carried input needed makes its output needed too.
    consts, carried = eqn.params["num_consts"], eqn.params["num_carry"]
    while True:
        ins = _needed_inputs(inner, outs)
        fed = ins[consts : consts + carried]
        grown = [o or i for o, i in zip(outs[:carried], fed, strict=True)]
        if grown == outs[:carried]:
            return ins
        outs = grown + outs[carried:]


# Equations that run one nested jaxpr on their own inputs to their own outputs (a scan
# too, its carry aside); any other (a while loop's condition, a cond's branches) is taken
# as a whole, which can only find a read where there is none, never miss one.
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "scan"}
    | {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
)


def _inner_jaxpr(eqn: Any) -> Any:
    """The nested jaxpr whose inputs and outputs are the equation's, else None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value) if hasattr(value, "consts") else value
        if (
            hasattr(inner, "eqns")
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return inner
    return None


def reads_batch(init: Callable[..., Any], leading: tuple[Any, ...], batch: Any) -> tuple[bool, Any]:
    """Whether `init(*leading, batch)` has a value that depends on one of `batch`'s values
    (`batch`: shapes and dtypes, `abstract_batch`), and its output's shapes and dtypes (as
    `jax.eval_shape` gives them); traced once, nothing is compiled."""
    traced, out = jax.make_jaxpr(init, return_shape=True)(*leading, batch)
    inputs = traced.jaxpr.invars[len(jax.tree.leaves(leading)) :]
    return reads_any(traced.jaxpr, inputs), out


def abstract_batch(treedef: Any, spec: Any) -> Any:
    """The first batch as shapes and dtypes, from its device signature `(treedef, spec)`."""
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in spec])


def zeros_batch(treedef: Any, spec: Any) -> Any:
    """A batch of zeros of the first batch's signature, made inside an init's program (an
    init that reads only the batch's shapes moves nothing to the device)."""
    return jax.tree.unflatten(treedef, [jnp.zeros(s, d) for s, d in spec])


def batch_values(first: Any) -> Any:
    """`first` on the device, for an init that reads its values (explicit: the run moves
    the batch again as data). Under several processes each holds only its rows of the
    first batch, and an init from them would differ between processes: refused."""
    if process_count() > 1:
        raise ValueError(
            "model: its init reads the first batch's values (a data-dependent "
            "initializer, e.g. an offset or a scale set from the batch's statistics), and "
            "under several processes each process holds only its rows of that batch. "
            "Initialise it once, from the same rows in every process, and pass the "
            "variables: run(data, model.init(rng, x))"
        )
    return jax.device_put(first)
