"""What k-fold cross-validation pays per fold for compiling, three ways (public API only).

Each fold trains a fresh nnx model (a new `nnx.Module`, seeded by the fold) for two
epochs on its own rows of one dataset, then predicts the held-out rows:

  * ``new``: a new `fl.trainer(model_k, ...)` per fold, as a first script would; every
    Loop traces and compiles its own programs;
  * ``reuse``: one trainer built once, each fold's fresh module passed to `run` as its
    starting weights (`loop.run(data, model_k)`), and `fl.predict` given the trainer's
    model with the fold's State: the programs compile at the first fold only;
  * ``cache``: as ``new``, with JAX's persistent compilation cache on (a temporary
    directory): each fold still traces its programs, and reads their executables from the
    cache instead of compiling them.

Each mode runs in a process of its own (the cache is a setting of the whole process, read
when JAX first compiles). The folds' parameters are checked equal across the modes.
Printed: each mode's first fold and the median of the later ones, in seconds.

Run: PYTHONPATH=src python bench/folds_compile.py [--folds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("new", "reuse", "cache")


def _fold_times(mode: str, folds: int) -> tuple[list[float], list[float]]:
    """Each fold's wall seconds (train and predict) under `mode`, and a checksum of each
    fold's trained parameters."""
    import jax

    if mode == "cache":  # before anything compiles
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="folds-"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import numpy as np
    import optax
    from flax import nnx

    import fuseloop as fl

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(8, 32, rngs=rngs)
            self.out = nnx.Linear(32, 3, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(nnx.relu(self.hidden(x)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype(np.float32)
    y = rng.integers(0, 3, 320).astype(np.int32)
    rows = np.array_split(np.arange(320), folds)
    loss, tx = "sparse_categorical_cross_entropy", optax.adam(1e-3)
    base = Net(nnx.Rngs(0))
    reused = fl.trainer(base, loss, tx)
    walls, sums = [], []
    for k in range(folds):
        train = np.setdiff1d(np.arange(320), rows[k])
        data = fl.data.arrays(x[train], y[train], 32, seed=k)
        model = Net(nnx.Rngs(k))
        began = time.perf_counter()
        if mode == "reuse":
            state = reused.run(data, model, epochs=2, fuse=True)
            out = fl.predict(base, state, x[rows[k]])
        else:
            state = fl.trainer(model, loss, tx).run(data, epochs=2, fuse=True)
            out = fl.predict(model, state, x[rows[k]])
        jax.block_until_ready(out)
        walls.append(time.perf_counter() - began)
        sums.append(
            float(sum(np.sum(np.asarray(p, np.float64)) for p in jax.tree.leaves(state.params)))
        )
    return walls, sums


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(_fold_times(args.mode, args.folds)))
        return
    results = {}
    for mode in MODES:
        child = [sys.executable, __file__, "--mode", mode, "--folds", str(args.folds)]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    checksums = {mode: sums for mode, (_, sums) in results.items()}
    if len({json.dumps(s) for s in checksums.values()}) != 1:
        raise SystemExit(f"the modes trained different parameters: {checksums}")
    print(f"{args.folds} folds, nnx MLP 8-32-3, 2 epochs of 8 batches each, then predict")
    for mode, (walls, _) in results.items():
        later = statistics.median(walls[1:])
        print(f"{mode:6s} first fold {walls[0]:6.2f} s   later folds, median {later:6.3f} s")


if __name__ == "__main__":
    main()
