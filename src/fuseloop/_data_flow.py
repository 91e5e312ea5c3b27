"""Which outputs of a traced function are computed from which of its inputs, read from its
jaxpr: whether a loss reads y at all, whether a model's output reads x, whether an nnx
module's output reads the numbers it draws."""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Var

__all__ = ["output_reads_inputs"]

# The operations that call a function of their own once (`jit` was `pjit` in older jax).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"})


def output_reads_inputs(closed: Any, inputs: int) -> bool:
    """Whether an output of the traced function `closed` (a ClosedJaxpr) is computed from
    one of its first `inputs` inputs. A call of a function of its own (`jax.jit`,
    `jax.checkpoint`) is followed inside; every other operation (a loop, a cond, a custom
    derivative) counts each of its outputs as computed from every input it reads.

    Example:
        >>> import jax
        >>> output_reads_inputs(jax.make_jaxpr(lambda a, b: b * 2)(1.0, 1.0), 1)
        False
        >>> output_reads_inputs(jax.make_jaxpr(jax.jit(lambda a, b: a + b))(1.0, 1.0), 1)
        True
    """
    jaxpr = closed.jaxpr
    return any(_flows(jaxpr, [i < inputs for i in range(len(jaxpr.invars))]))


def _flows(jaxpr: Jaxpr, reading: list[bool]) -> list[bool]:
    """For each output of `jaxpr`, whether it is computed from an input flagged in
    `reading` (one flag per input)."""
    read = {v for v, flag in zip(jaxpr.invars, reading, strict=True) if flag}
    for equation in jaxpr.eqns:
        flags = [isinstance(v, Var) and v in read for v in equation.invars]
        if not any(flags):
            continue
        inner = _called(equation)
        if inner is None:  # conservative: every output of an operation that reads one
            read.update(equation.outvars)
            continue
        outs = _flows(inner, flags)
        read.update(v for v, flag in zip(equation.outvars, outs, strict=True) if flag)
    return [isinstance(v, Var) and v in read for v in jaxpr.outvars]


def _called(equation: Any) -> Jaxpr | None:
    """The function a call operation runs on its own inputs and outputs one for one (a
    jit, a checkpoint), or None for any other operation. Known calls alone: a loop's body
    has the same arity and would be followed through one pass, missing what it carries
    from one pass to the next; and a custom derivative's rule (`jax.custom_jvp`,
    `jax.custom_vjp`) may read what its primal drops (a surrogate objective's gradient)."""
    if equation.primitive.name not in _CALLS:
        return None
    for value in equation.params.values():
        inner = value.jaxpr if isinstance(value, ClosedJaxpr) else value
        if (
            isinstance(inner, Jaxpr)
            and len(inner.invars) == len(equation.invars)
            and len(inner.outvars) == len(equation.outvars)
            and not inner.constvars
        ):
            return inner
    return None
