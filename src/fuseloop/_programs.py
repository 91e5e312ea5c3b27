"""The loop's compiled programs, cached on the Loop so a second run does not recompile.

Every step a jitted run takes, fused or not, runs inside one and the same device loop
(`_fusion.make_chunk_fn`). The unfused loop hands it a chunk of `MIN_SLOTS` slots with one
live batch. That is what makes fused and unfused runs agree to the bit: XLA on CPU contracts
multiply-adds and orders reductions according to the surrounding program, so a step jitted
on its own and the same step inside a while loop can differ in the last bit (DESIGN.md §2);
the loop body here is compiled the same way whatever the chunk size, while a one-slot loop
would be simplified away, hence at least two slots. Metrics are always recorded per slot for
the same reason: the body never changes with what the host happens to need.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from ._fusion import make_chunk_fn
from ._step import init_tail, make_carry_step

__all__ = ["Programs", "MIN_SLOTS"]

MIN_SLOTS = 2


class Programs:
    """Builds (once per Loop) and hands out the jitted programs of a run."""

    def __init__(self, loop: Any):
        self.loop, self.cache = loop, loop._cache
        self.cache.setdefault("traces", [0])
        self.guard = loop.guard_nonfinite

    @property
    def traces(self) -> int:
        """How many times a program of this Loop was traced (each trace is a compile)."""
        return self.cache["traces"][0]

    def counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        counter = self.cache["traces"]

        def traced(*args: Any) -> Any:
            counter[0] += 1  # runs at trace time only: one per compile
            return fn(*args)

        return traced

    def _jit(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        donate = (0, 1) if self.loop.program.donate_state else (1,)
        return jax.jit(self.counted(fn), donate_argnums=donate, **kwargs)

    def _carry_step(self) -> Any:
        return make_carry_step(self.loop.program, self.loop.metrics, self.guard)

    def eager_step(self) -> Any:
        """`jit=False`: one step, op by op, for debugging."""
        return self._carry_step()

    def chunk(self) -> Any:
        """`(state, tail, stacked_chunk, n_valid) -> (state, tail, records, n_run)`."""
        key = ("chunk", self.guard)
        if key not in self.cache:
            self.cache[key] = self._jit(make_chunk_fn(self._carry_step(), True, self.guard))
        return self.cache[key]

    def unfused(self) -> Any:
        """`(state, tail, batch, n_valid) -> (state, tail)`: one step through the chunk loop.

        The batch is widened to `MIN_SLOTS` slots on the device (a broadcast outside the
        loop), so the host moves it once, as it is, and the loop body stays the fused one.
        `n_valid` (always 1) is a runtime value so XLA cannot see a one-trip loop and
        simplify it away.
        """
        key = ("unfused", self.guard)
        if key not in self.cache:
            body = make_chunk_fn(self._carry_step(), True, self.guard)

            def program(state: Any, tail: Any, batch: Any, n_valid: Any) -> tuple[Any, Any]:
                chunk = jax.tree.map(
                    lambda a: jnp.broadcast_to(a[None], (MIN_SLOTS,) + a.shape), batch)
                state, tail, _, _ = body(state, tail, chunk, n_valid)
                return state, tail

            self.cache[key] = self._jit(program)
        return self.cache[key]

    def resident(self, slots: int, live: int, sharding: Any = None) -> Any:
        """The chunk program over a device-resident dataset.

        `(state, tail, data, indices, cursor, limit) -> (state, tail, records, n_run, cursor)`:
        the chunk's rows are gathered on the device, then stepped by the same loop as a
        host-fed chunk; at most `live` of the `slots` slots run (1 for an unfused step).
        `sharding` (over a mesh) is imposed on the gathered chunk.
        """
        key = ("resident", self.guard, slots, live, sharding)
        if key in self.cache:
            return self.cache[key]
        body = make_chunk_fn(self._carry_step(), True, self.guard)

        def program(state: Any, tail: Any, data: Any, indices: Any, cursor: Any,
                    limit: Any) -> tuple[Any, ...]:
            # Slots past the epoch's end gather clamped (valid) rows; they are never stepped.
            rows = indices[jnp.minimum(cursor + jnp.arange(slots), indices.shape[0] - 1)]
            chunk = jax.tree.map(lambda leaf: leaf[rows], data)
            if sharding is not None:
                chunk = jax.lax.with_sharding_constraint(chunk, sharding)
            n_valid = jnp.minimum(live, limit - cursor)
            state, tail, records, n_run = body(state, tail, chunk, n_valid)
            return state, tail, records, n_run, cursor + n_run

        self.cache[key] = self._jit(program, static_argnums=(5,))
        return self.cache[key]

    def fresh_tail(self) -> Any:
        """Zeroed metric accumulators (and guard flag), made by one cached program."""
        key = ("tail", self.guard)
        if key not in self.cache:
            metrics, guard = self.loop.metrics, self.guard
            self.cache[key] = jax.jit(lambda: init_tail(metrics, guard))
        return self.cache[key]()
