"""What the spares save a run's start (docs/design.md §6), paired in one process.

Three kinds of round, in turn, each timing `run(epochs=1)` of mlp-tiny at fuse=32 (after
another loop's run, so the machine is not idle-warm):

  * never: no spare is made or taken (the engine before spares);
  * cleared: spares are made but cleared before the run (a run from new variables);
  * kept: the run takes the spares its predecessor made (a run from the same variables).

Run: PYTHONPATH=src python bench/spares.py [--rounds 300]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
from engine_costs import mlp_tiny, rounds_from_argv, tiny_trainer

from fuseloop.engine import host

KINDS = ("never", "cleared", "kept")


def main() -> None:
    rounds = rounds_from_argv(300)
    model, variables, batches = mlp_tiny()
    loop = tiny_trainer(model)
    other = tiny_trainer(model)
    for _ in range(5):
        loop.run(batches, variables, fuse=32)
    making = {"on": True}
    queue = host.HostReads.before_waiting

    def maybe_queue(self: Any, work: Any) -> None:
        if making["on"]:
            queue(self, work)

    host.HostReads.before_waiting = maybe_queue  # type: ignore[method-assign]
    walls: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for r in range(rounds * len(KINDS)):
        kind = KINDS[r % len(KINDS)]  # "kept" follows "cleared", which made spares
        making["on"] = kind != "never"
        other.run(batches[:40], variables, fuse=32)
        if kind != "kept":
            for init in loop._programs.init.values():
                init._spare = None
            loop._programs.spare_tail = None
        began = time.perf_counter()
        jax.block_until_ready(loop.run(batches, variables, fuse=32).step_state)
        walls[kind].append(time.perf_counter() - began)
    for kind in KINDS:
        v = walls[kind]
        print(f"{kind:8s} median {statistics.median(v) * 1e6:7.0f} us   min {min(v) * 1e6:7.0f} us")
    saved = statistics.median(walls["cleared"]) - statistics.median(walls["kept"])
    cost = statistics.median(walls["cleared"]) - statistics.median(walls["never"])
    print(f"taking the spares saves {saved * 1e6:.0f} us; making them costs {cost * 1e6:.0f} us")


if __name__ == "__main__":
    main()
