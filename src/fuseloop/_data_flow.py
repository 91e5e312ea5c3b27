"""Which outputs of a traced function are computed from which of its inputs, read from its
jaxpr: whether a loss reads y at all, whether a model's output reads x, whether an nnx
module's output reads the numbers it draws, and which outputs hand an input on unchanged
(an nnx Variable that `nnx.remat` writes back as a new value); and how many times it
draws random bits (a plain function's flag that turns its dropout on)."""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Var

__all__ = ["draws", "output_reads_inputs", "passed_on"]

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


def passed_on(closed: Any) -> list[int | None]:
    """For each output of the traced function `closed` (a ClosedJaxpr), the index of the
    input it hands on unchanged, else None. Followed through calls of a function of their
    own (`jax.jit`, `jax.checkpoint`) and through a scan's body (a carry handed back as it
    came, a scanned input handed out as the stacked output); any other operation's outputs
    are new values.

    Example:
        >>> import jax
        >>> passed_on(jax.make_jaxpr(jax.checkpoint(lambda a, b: (b, a * 2)))(1.0, 1.0))
        [1, None]
    """
    return _passed_on(closed.jaxpr)


def _passed_on(jaxpr: Jaxpr) -> list[int | None]:
    origin: dict[Var, int] = {v: i for i, v in enumerate(jaxpr.invars)}
    for equation in jaxpr.eqns:
        for out, source in _handed_through(equation):
            given = equation.invars[source]
            if isinstance(given, Var) and given in origin:
                origin[out] = origin[given]
    return [origin.get(v) if isinstance(v, Var) else None for v in jaxpr.outvars]


def _handed_through(equation: Any) -> list[tuple[Var, int]]:
    """`(output, index of the operation's input it is)` for each output `equation` hands
    on unchanged (a call's, a scan's; none of any other operation)."""
    inner = _called(equation)
    if inner is not None:
        pairs = enumerate(_passed_on(inner))
        return [(equation.outvars[i], j) for i, j in pairs if j is not None]
    if equation.primitive.name != "scan":
        return []
    consts, carried = equation.params["num_consts"], equation.params["num_carry"]
    body = equation.params["jaxpr"].jaxpr
    found: list[tuple[Var, int]] = []
    for i, j in enumerate(_passed_on(body)):
        if j is None:
            continue
        carry_kept = i < carried and j == consts + i
        scanned = i >= carried and j >= consts + carried  # an xs, sliced, stacked again
        if carry_kept or scanned:
            found.append((equation.outvars[i], j))
    return found


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


def draws(closed: Any) -> int:
    """How many times the traced function `closed` (a ClosedJaxpr) draws random bits
    (`random_bits` operations), in calls, loops and branches too, each counted once.

    Example:
        >>> import jax
        >>> key = jax.random.PRNGKey(0)
        >>> draws(jax.make_jaxpr(lambda k: jax.random.normal(k) + jax.random.uniform(k))(key))
        2
    """
    return _draws(closed.jaxpr)


def _draws(jaxpr: Jaxpr) -> int:
    found = 0
    for equation in jaxpr.eqns:
        found += equation.primitive.name == "random_bits"
        for value in equation.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
                if isinstance(inner, Jaxpr):
                    found += _draws(inner)
    return found
