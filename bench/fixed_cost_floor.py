"""How much of a one-epoch run's fixed cost is the engine's (mlp-tiny, host-fed, fuse=32).

Times, interleaved in one process, medians over rounds:

  * `run(epochs=1)` through the public API;
  * the least such a run must do, with fuseloop's own compiled programs and no engine
    around them: the initial step state and zeroed accumulators (spares, as the engine
    takes them, and the next run's made after the first launch), then for each chunk of
    32 batches the stacking and the launch, and the final read of the accumulators;
  * a steady epoch (the median epoch of a 6-epoch run, its first excluded).

`run1 - steady` is the fixed cost `bench/engine_costs.py` reports; `least - steady` is
what remains of it without the engine's bookkeeping (checks, events, replay, State):
starting the device on a run's first chunk and waiting for its last one.
This script reaches into private modules on purpose (it measures the engine against
its own parts); `bench/engine_costs.py` uses the public API only.

Run: python bench/fixed_cost_floor.py [--rounds 300]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from engine_costs import mlp_tiny, rounds_from_argv, tiny_trainer

from fuseloop._fusion import stack_chunk
from fuseloop._placement import device_int
from fuseloop.engine.programs import Programs

K = 32  # batches per chunk, over mlp-tiny's epoch of 100 (engine_costs.mlp_tiny)


def main() -> None:
    rounds = rounds_from_argv(300)
    model, variables, batches = mlp_tiny()
    loop = tiny_trainer(model)
    loop.run(batches, variables, fuse=K)  # compiles every program the two sides use
    programs = Programs(loop)
    (init,) = programs.cache.init.values()
    chunk = programs.chunk()

    def least() -> Any:
        # The initial state and accumulators as the engine takes them: spares made while
        # the run before waited, and the next run's made once the first chunk is launched.
        state, _, make_state = init.start(variables)
        tail, make_tail = programs.epoch_tail()
        for first in range(0, len(batches), K):
            part = batches[first : first + K]
            stacked = stack_chunk(part, K, first)
            # The count as the engine passes it on one device: a shared device scalar.
            state, tail, _, _ = chunk(state, tail, stacked, device_int(len(part)))
            if first == 0:
                for make in (make_state, make_tail):
                    if make is not None:
                        make()
        np.asarray(tail["acc"]["loss"]["sum"])  # the final read
        return state

    def wall(fn: Callable[[], Any]) -> float:
        began = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - began

    def steady() -> float:
        times = loop.run(batches, variables, fuse=K, epochs=6).times
        return statistics.median(times[e] for e in range(1, 6))

    got: dict[str, list[float]] = {"run1": [], "least": [], "steady": []}
    for _ in range(rounds):
        got["run1"].append(wall(lambda: loop.run(batches, variables, fuse=K).step_state))
        got["least"].append(wall(least))
        got["steady"].append(steady())
    median = {name: statistics.median(values) * 1e3 for name, values in got.items()}
    for name, value in median.items():
        print(f"{name:8s} {value:7.3f} ms")
    for name in ("run1", "least"):
        paired = [a - b for a, b in zip(got[name], got["steady"], strict=True)]
        print(f"{name} - steady: {statistics.median(paired) * 1e3:.3f} ms (paired per round)")


if __name__ == "__main__":
    main()
