"""What the chunks' copy of their carry saves a run with an iteration handler
(docs/design.md §6, "Launch ahead"), paired in one process.

Two trainers of mlp-tiny, each as it is and with a handler firing every 50 iterations:
one whose chunks copy their carry (the engine as it is), one whose snapshots are packed
by a program of their own (the engine before the copy). Every round runs the four
3-epoch runs at fuse=32, in alternating order; the report gives the handler ratio of each
engine (run3h / run3, paired per round) and the ratio of the two engines' handled runs.

Run: PYTHONPATH=src python bench/carry_copy.py [--rounds 300]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
from engine_costs import mlp_tiny, rounds_from_argv, tiny_trainer

import fuseloop as fl
from fuseloop.engine import programs


def main() -> None:
    rounds = rounds_from_argv(300)
    model, variables, batches = mlp_tiny()

    def pair() -> tuple[fl.Loop, fl.Loop]:
        base = tiny_trainer(model)
        return base, base.handle_event("iteration_completed", lambda s: None, {"every": 50})

    loops = {"copy": pair(), "pack": pair()}
    packing = {id(loops["pack"][0]._programs)}  # its loops share one program cache
    build = programs.Programs.__init__

    def without_copies(self: Any, loop: Any, population: Any = None, copies: bool = False):
        build(self, loop, population, copies and id(loop._programs) not in packing)

    programs.Programs.__init__ = without_copies  # type: ignore[method-assign]
    cases = [(engine, handled) for engine in loops for handled in (0, 1)]

    def wall(engine: str, handled: int) -> float:
        began = time.perf_counter()
        state = loops[engine][handled].run(batches, variables, fuse=32, epochs=3)
        jax.block_until_ready(state.step_state)
        return time.perf_counter() - began

    for case in cases:  # compile and warm up
        wall(*case), wall(*case)
    got: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    for r in range(rounds):
        for case in cases if r % 2 else cases[::-1]:
            got[case].append(wall(*case))
    for case in cases:
        name = f"{case[0]} {'run3h' if case[1] else 'run3 '}"
        print(f"{name}  median {statistics.median(got[case]) * 1e3:7.3f} ms")
    for engine in loops:
        ratio = [h / p for p, h in zip(got[(engine, 0)], got[(engine, 1)], strict=True)]
        print(f"handler ratio, {engine}: {statistics.median(ratio):.3f}  target <= 1.05")
    copied = [c / p for c, p in zip(got[("copy", 1)], got[("pack", 1)], strict=True)]
    print(f"run3h, copy / pack: {statistics.median(copied):.3f}")


if __name__ == "__main__":
    main()
