"""`_data_flow.output_reads_inputs`, which decides whether a loss reads y, a model reads x
and an nnx module's evaluation reads its draws: a call is followed inside, anything else
counts as reading all it is given (a miss there would let a wrong model train in silence)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fuseloop._data_flow import output_reads_inputs


def _reads_first(fn, *args) -> bool:
    return output_reads_inputs(jax.make_jaxpr(fn)(*args), 1)


def _delayed(a):
    """`a` reaches the output only after two passes of a loop's body."""

    def body(carry, _):
        first, second = carry
        return (a, first), second

    return lax.scan(body, (jnp.zeros(()), jnp.zeros(())), None, length=3)[0][1]


@jax.custom_vjp
def _surrogate(a, b):
    return b * 2.0


_surrogate.defvjp(lambda a, b: (b * 2.0, a), lambda a, g: (None, g * a))


def test_calls_are_followed_and_what_they_drop_is_not_read():
    assert not _reads_first(lambda a, b: b * 2.0, 1.0, 1.0)
    assert not _reads_first(jax.jit(lambda a, b: b.sum()), 1.0, jnp.ones(3))
    assert not _reads_first(jax.checkpoint(lambda a, b: b + 1.0), 1.0, 1.0)
    assert not _reads_first(lambda a, b: (a * 2.0, b)[1], 1.0, 1.0)  # computed, then dropped
    assert _reads_first(jax.jit(lambda a, b: a + b), 1.0, 1.0)


def test_loops_conds_and_custom_vjps_count_as_reading_all_they_are_given():
    # A loop's body has the loop's arity: followed through one pass, it missed a value
    # carried over two, and a trip count.
    assert _reads_first(lambda a, b: _delayed(a) + b, 1.0, 1.0)
    assert _reads_first(
        lambda a, b: lax.fori_loop(0, a.astype(int), lambda i, c: c + 1.0, b), 3.0, 0.0
    )
    assert _reads_first(lambda a, b: lax.cond(a > 0, lambda: b, lambda: -b), 1.0, 1.0)
    # Its primal drops `a`, its backward pass reads it.
    assert _reads_first(_surrogate, 1.0, 1.0)
