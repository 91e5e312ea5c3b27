"""What a launch costs the host per buffer it takes and returns (plain jax, no fuseloop).

A fused chunk's launch passes the carry (step state and accumulators) in and out: for
mlp-tiny with Adam, 15 step-state leaves, 2 accumulators, the chunk and its count in, and
about 20 arrays out. This script times, on the calling thread, one jitted call whose loop
updates `n` donated leaves, for several `n`, and the same total work in one leaf:

  * `cheap` programs (under XLA:CPU's threshold of 1000 flops) run on the calling thread,
    so their time includes the work;
  * larger ones are handed to XLA's threads, and the call returns once it is queued: its
    time is the dispatch alone, which grows with the number of buffers, not the work.

It is the measurement behind docs/design.md §6 ("what a launch costs per buffer"): the
next lever on the fixed cost of a run is fewer, larger carry buffers.

Run: python bench/dispatch_per_buffer.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def _program() -> Any:
    """One jitted loop over a list of donated leaves (a new length traces it again)."""

    def body(state: list[Any], trips: Any) -> tuple[list[Any], Any]:
        def step(_: Any, carry: list[Any]) -> list[Any]:
            return [x * 1.0001 + 1.0 for x in carry]

        return lax.fori_loop(0, trips, step, state), trips

    return jax.jit(body, donate_argnums=0)


def _call_seconds(leaves: int, size: int, calls: int) -> float:
    """The median host time of one call (the device finishes before the next)."""
    program = _program()
    trips = jnp.int32(2)
    state = [jnp.full((size,), float(i), jnp.float32) for i in range(leaves)]
    state, _ = program(state, trips)
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        state, _ = program(state, trips)
        times.append(time.perf_counter() - began)
        jax.block_until_ready(state)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    calls = parser.parse_args().calls
    print(f"{'leaves':>6} {'floats each':>12} {'host us per call':>17}")
    for leaves, size in ((1, 8), (16, 8), (1, 65536), (4, 16384), (16, 4096), (32, 2048)):
        seconds = _call_seconds(leaves, size, calls)
        print(f"{leaves:>6} {size:>12} {seconds * 1e6:>17.1f}")


if __name__ == "__main__":
    main()
