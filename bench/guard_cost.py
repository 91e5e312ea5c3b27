"""What `terminate_on_nan()` costs a finite run, on the benchmark MLPs (public API only).

Per model, a steady epoch of `fuse=32` host-fed training with and without the guard,
medians over interleaved rounds (each round runs both, in turn), and a check that the two
end bitwise equal (the guard must change nothing in a finite run; docs/design.md §2).

Run: PYTHONPATH=src python bench/guard_cost.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
import optax

import fuseloop as fl

MODELS = {  # name: (inputs, widths), as `fuseloop bench`
    "mlp-tiny": (24, [32, 10]),
    "mlp-small": (784, [32, 10]),
    "mlp-large": (784, [1024, 384, 10]),
}
BATCH, N_BATCHES = 32, 100


def _batches(inputs: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N_BATCHES * BATCH, inputs)).astype(np.float32)
    y = rng.integers(0, 10, N_BATCHES * BATCH).astype(np.int32)
    return [
        (x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(N_BATCHES)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    print(f"steady epoch, fuse=32, batch {BATCH}, {N_BATCHES} batches; median over {rounds} rounds")
    for name, (inputs, widths) in MODELS.items():
        batches = _batches(inputs)
        plain = fl.trainer(
            fl.models.mlp(widths), "sparse_categorical_cross_entropy", optax.adam(1e-3)
        )
        loops = {"plain": plain, "guarded": plain.terminate_on_nan()}
        epochs = 4 if name == "mlp-large" else 11
        times: dict[str, list[float]] = {k: [] for k in loops}
        ends = {k: loop.run(batches, fuse=32, epochs=2) for k, loop in loops.items()}  # compiles
        for _ in range(rounds if name != "mlp-large" else max(2, rounds // 2)):
            for kind, loop in loops.items():
                state = loop.run(batches, fuse=32, epochs=epochs)
                times[kind] += [state.times[e] for e in range(1, epochs)]
        same = all(
            np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(ends["plain"].step_state),
                jax.tree.leaves(ends["guarded"].step_state),
                strict=True,
            )
        )
        p, g = statistics.median(times["plain"]), statistics.median(times["guarded"])
        print(
            f"  {name:10s} plain {p * 1e3:8.3f} ms   guarded {g * 1e3:8.3f} ms   "
            f"ratio {g / p:.3f}   bitwise equal: {same}"
        )


if __name__ == "__main__":
    main()
