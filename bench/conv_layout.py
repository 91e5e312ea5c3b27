"""The zoo CNN's training step inside a device loop, under XLA's layout and fuseloop's.

XLA:CPU runs a convolution fast only channel-last, and inside a loop body it leaves the
kernel gradient autodiff builds in its own form (docs/design.md §10). This script times
the zoo's CNN train step (Conv16+BN, Conv32+BN, avgpool, Dense10; batch 32 of 8x8x1) as:

  * plain: the step jitted alone, once per call;
  * loop, XLA's layout: the same step in a `lax.fori_loop` of 32 trips, jitted as any user
    program is;
  * loop, channel-last: the same loop, lowered as fuseloop lowers its own programs;

medians over interleaved rounds, in microseconds per step, and checks that the two loops
and 32 plain calls end with the same parameters.

Run: PYTHONPATH=src python bench/conv_layout.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fuseloop.bench._zoo_models import DigitsCNN
from fuseloop.engine import conv_layout

TRIPS, BATCH = 32, 32


def _step() -> tuple[Callable[[Any], Any], Any]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(size=(BATCH, 8, 8, 1)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, BATCH).astype(np.int32))
    model, tx = DigitsCNN(), optax.adam(1e-3)
    variables = model.init(jax.random.PRNGKey(0), x)

    def step(carry: Any) -> Any:
        params, stats, opt_state = carry

        def loss_fn(p: Any) -> Any:
            logits, updated = model.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updated

        (_, updated), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), updated["batch_stats"], opt_state

    params = variables["params"]
    return step, (params, variables["batch_stats"], tx.init(params))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    step, carry = _step()

    def looped(carry: Any, trips: Any) -> Any:
        return lax.fori_loop(0, trips, lambda _, c: step(c), carry)

    plain = jax.jit(step)
    xla_loop = jax.jit(looped)
    ours = jax.jit(conv_layout.named(looped, "bench_loop"))
    trips = jnp.int32(TRIPS)

    def plain_steps() -> Any:
        c = carry
        for _ in range(TRIPS):
            c = plain(c)
        return c

    systems = {
        "plain (jit of one step)": plain_steps,
        "loop, XLA's layout": lambda: xla_loop(carry, trips),
        "loop, channel-last (fuseloop)": lambda: ours(carry, trips),
    }
    ends = {name: jax.block_until_ready(run()) for name, run in systems.items()}  # compiles
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, run in systems.items():
            began = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append((time.perf_counter() - began) / TRIPS)
    print(f"zoo CNN train step, batch {BATCH}, {TRIPS} steps per sample, {rounds} rounds")
    for name, seconds in times.items():
        print(
            f"  {name:32s} median {statistics.median(seconds) * 1e6:9.1f} us/step"
            f"   min {min(seconds) * 1e6:9.1f}"
        )
    reference = jax.tree.leaves(ends["plain (jit of one step)"])
    for name in list(systems)[1:]:
        leaves = jax.tree.leaves(ends[name])
        same = all(np.array_equal(a, b) for a, b in zip(reference, leaves, strict=True))
        worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(reference, leaves, strict=True))
        print(f"  {name} vs plain: bitwise {same}, largest difference {worst:.3g}")


if __name__ == "__main__":
    main()
