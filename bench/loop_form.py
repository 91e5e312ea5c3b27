"""What the device loop's form costs a step, on the machine's default backend (mlp-tiny).

The chunk loop must run `n_valid <= K` steps, `n_valid` known only at run time. Per form,
a jitted loop over K = 32 batches already on the device, called back to back, microseconds
per step (median of rounds):

  * `scan`: `lax.scan` over the K batches, all live (the floor);
  * `while`: `lax.while_loop` while `i < n_valid` (fuseloop's form on a CPU);
  * `while + guard`: the same, also stopping at a non-finite loss;
  * `scan + select`: `lax.scan` over every slot, each step committed by a select where
    `i < n_valid` (fuseloop's form elsewhere);
  * `scan + cond`: `lax.scan` over every slot, each step under `lax.cond(i < n_valid)`.

Then fuseloop's own steady epochs under each of its two forms (`FUSELOOP_DEVICE_LOOP`,
read when a program is traced): device-resident data, `fuse=32`, in milliseconds.

On a CPU the forms cost about the same; on a GPU a while loop with a runtime trip count
copies its condition to the host after every step and waits for it (docs/design.md §2,
"The loop's form on each backend").

Run: PYTHONPATH=src python bench/loop_form.py [--rounds 5]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from engine_costs import BATCH, floor_step, mlp_tiny, rounds_from_argv
from jax import lax

import fuseloop as fl

K, CALLS = 32, 30


def _forms(step: Callable[[Any, Any], Any]) -> dict[str, Callable[..., Any]]:
    def scan(c: Any, xs: Any, ys: Any, n: Any) -> Any:
        return lax.scan(step, c, (xs, ys))[0]

    def while_(c: Any, xs: Any, ys: Any, n: Any) -> Any:
        def body(s: Any) -> Any:
            return s[0] + 1, step(s[1], (xs[s[0]], ys[s[0]]))[0]

        return lax.while_loop(lambda s: s[0] < n, body, (0, c))[1]

    def while_guard(c: Any, xs: Any, ys: Any, n: Any) -> Any:
        def body(s: Any) -> Any:
            c, loss = step(s[1], (xs[s[0]], ys[s[0]]))
            return s[0] + 1, c, ~jnp.isfinite(loss)

        return lax.while_loop(lambda s: (s[0] < n) & ~s[2], body, (0, c, False))[1]

    def scan_select(c: Any, xs: Any, ys: Any, n: Any) -> Any:
        def body(c: Any, i: Any) -> Any:
            new = step(c, (xs[i], ys[i]))[0]
            return jax.tree.map(lambda a, b: lax.select(i < n, a, b), new, c), None

        return lax.scan(body, c, jnp.arange(K))[0]

    def scan_cond(c: Any, xs: Any, ys: Any, n: Any) -> Any:
        def body(c: Any, i: Any) -> Any:
            return lax.cond(i < n, lambda c: step(c, (xs[i], ys[i]))[0], lambda c: c, c), None

        return lax.scan(body, c, jnp.arange(K))[0]

    return {
        "scan": scan,
        "while": while_,
        "while + guard": while_guard,
        "scan + select": scan_select,
        "scan + cond": scan_cond,
    }


def _per_step_us(loop: Callable[..., Any], carry: Any, data: tuple[Any, ...], rounds: int) -> float:
    compiled = jax.jit(loop, donate_argnums=0)
    carry = jax.block_until_ready(compiled(carry, *data))
    samples = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(CALLS):
            carry = compiled(carry, *data)
        jax.block_until_ready(carry)
        samples.append((time.perf_counter() - began) / CALLS / K * 1e6)
    return statistics.median(samples)


def _epoch_ms(form: str, model: Any, variables: Any, x: np.ndarray, y: np.ndarray) -> float:
    os.environ["FUSELOOP_DEVICE_LOOP"] = form  # read when the new trainer's programs trace
    try:
        source = fl.data.arrays(x, y, batch_size=BATCH, shuffle=False, device=True)
        loop = fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-3))
        state = loop.run(source, variables, epochs=8, fuse=32)
    finally:
        del os.environ["FUSELOOP_DEVICE_LOOP"]
    return statistics.median(state.times[e] for e in sorted(state.times)[1:]) * 1e3


def main() -> None:
    rounds = rounds_from_argv(5)
    model, variables, batches = mlp_tiny()
    tx = optax.adam(1e-3)
    step = floor_step(model, tx)
    xs = jnp.asarray(np.stack([b[0] for b in batches[:K]]))
    ys = jnp.asarray(np.stack([b[1] for b in batches[:K]]))
    print(f"backend: {jax.default_backend()}; K = {K}, all {K} steps live")
    for name, loop in _forms(step).items():
        carry = jax.tree.map(jnp.array, (variables, tx.init(variables)))
        us = _per_step_us(loop, carry, (xs, ys, jnp.int32(K)), rounds)
        print(f"{name:15s} {us:8.2f} us/step")
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    for form in ("while", "scan"):
        ms = _epoch_ms(form, model, variables, x, y)
        print(f"fuseloop resident fuse=32, {form} form: {ms:.3f} ms/epoch")


if __name__ == "__main__":
    main()
