"""What a sweep pays per setting: a new trainer per learning rate over one dataset.

Each setting builds its own trainer (a new Loop, so new programs) and runs it once over
the same device-resident data. The first trainer compiles everything; a later one
compiles only its own model's programs (init, steps), since the programs that depend on
the data alone are shared by every Loop of the process (docs/design.md §4). Printed: the
first trainer's run, the later ones' (median and range), and the programs a later run
compiled (from jax's compile log).

Run: PYTHONPATH=src python bench/sweep_compile.py [--settings 6]
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import time

import jax
import numpy as np
import optax

import fuseloop as fl


class _Compiled(logging.Handler):
    """The names of the programs jax compiles while attached."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.match(r"Compiling (\S+)", record.getMessage())
        if match:
            self.names.append(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", type=int, default=6)
    settings = parser.parse_args().settings
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 12)).astype(np.float32)
    data = fl.data.arrays(x, rng.integers(0, 3, 512).astype(np.int32), 32, device=True)
    logger, compiled = logging.getLogger("jax"), _Compiled()
    logger.addHandler(compiled)
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    walls = []
    for rate in np.geomspace(0.1, 0.001, settings):
        compiled.names.clear()
        loop = fl.trainer(
            fl.models.mlp([16, 3]), "sparse_categorical_cross_entropy", optax.sgd(rate)
        )
        began = time.perf_counter()
        loop.metric("accuracy").run(data, epochs=2, fuse=8)
        walls.append(time.perf_counter() - began)
    later = walls[1:]
    print(f"first trainer's run: {walls[0]:.2f} s")
    print(
        f"later trainers' runs: median {statistics.median(later):.2f} s "
        f"({min(later):.2f}-{max(later):.2f} s)"
    )
    print(f"a later run compiled: {', '.join(sorted(set(compiled.names)))}")


if __name__ == "__main__":
    main()
