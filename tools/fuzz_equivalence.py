"""A differential fuzz of the fused loop against the unfused loop, over user configurations.

Each drawn configuration (seeded, so a failure is replayable) picks a model kind (linen
MLP, linen with BatchNorm and Dropout, bf16 linen, nnx, equinox, plain functions), a data
source (a list, a callable, host or device-resident `fl.data.arrays`, shuffled or not,
with or without a short last batch), an optimizer, metrics, validation (host or resident,
fused or not), early stopping, LR-on-plateau, the NaN guard, an observer, a log, an epoch
handler that halts, an iteration bound, a resume, a population, and a `fuse` value; with
two or more devices also a mesh. It runs the configuration unfused and with its
`fuse`, and compares everything a user can see: the whole step state bitwise, history,
metrics, event counts, status, epoch, the observer's records and the log text. A
device-resident source is also compared with the same batches fed from the host.

Both sides raising the same error counts as agreement; a fused run refusing a short batch
with `FusionError` (docs/design.md: a chunk stacks batches of one shape) is reported and
not counted as a mismatch. A mismatch is run again before it is reported.

    python tools/fuzz_equivalence.py --seed 0 --count 200
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tools/fuzz_equivalence.py

Exit status 1 if any configuration disagrees. Stop it with Ctrl-C twice: fuseloop turns
the first SIGINT or SIGTERM into a halt of the run under way, and goes on.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import fuseloop as fl

FEATURES, CLASSES = 5, 3
SPARSE = "sparse_categorical_cross_entropy"


class LinenDropBN(nn.Module):
    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
        return nn.Dense(CLASSES)(x)


class LinenBf16(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = nn.relu(nn.Dense(8, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(x))
        return nn.Dense(CLASSES, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.out(self.drop(nnx.relu(self.norm(self.dense(x)))))


class EqxNet(eqx.Module):
    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key: Any):
        k1, k2 = jax.random.split(key)
        self.dense = eqx.nn.Linear(FEATURES, 8, key=k1)
        self.drop = eqx.nn.Dropout(0.3)
        self.out = eqx.nn.Linear(8, CLASSES, key=k2)

    def __call__(self, x: Any, key: Any = None) -> Any:
        return self.out(self.drop(jax.nn.relu(self.dense(x)), key=key))


def _plain() -> Any:
    def init(rng: Any, x: Any) -> Any:
        return {"w": jax.random.normal(rng, (x.shape[-1], CLASSES)) * 0.1, "b": jnp.zeros(CLASSES)}

    return fl.models.from_functions(init, lambda p, x: x @ p["w"] + p["b"])


MODELS: dict[str, Callable[[], Any]] = {
    "mlp": lambda: fl.models.mlp([8, CLASSES]),
    "linen_dropbn": LinenDropBN,
    "bf16": LinenBf16,
    "nnx": lambda: NnxNet(nnx.Rngs(0)),
    "eqx": lambda: EqxNet(jax.random.PRNGKey(0)),
    "plain": _plain,
}


def _examples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=(FEATURES, CLASSES))).argmax(1).astype(np.int32)
    return x, y


def _source(kind: str, n: int, seed: int, bs: int, shuffle: bool, drop: bool) -> Any:
    x, y = _examples(n, seed)
    batches = [(x[i : i + bs], y[i : i + bs]) for i in range(0, n, bs)]
    if kind == "list":
        return batches
    if kind == "callable":
        return lambda: iter(batches)
    device = kind == "device"
    return fl.data.arrays(x, y, batch_size=bs, shuffle=shuffle, drop_remainder=drop, device=device)


def _loop(cfg: dict[str, Any], records: list[Any], log: io.StringIO) -> fl.Loop:
    """The trainer the configuration describes; the observer appends to `records`."""
    model = MODELS[cfg["model"]]()
    loop = fl.trainer(model, SPARSE, cfg["opt"], seed=cfg["seed"], log=cfg["log"], log_stream=log)
    if cfg["acc"]:
        loop = loop.metric("accuracy")
    if cfg["val"]:
        val = _source(cfg["val"], cfg["vn"], 99, cfg["vbs"], False, False)
        loop = loop.validate(model, val, fuse=cfg["vfuse"])
    monitor = "validation_loss" if cfg["val"] else "loss"
    if cfg["early"]:
        loop = loop.early_stop(
            monitor, patience=cfg["patience"], restore_best=cfg["restore"], min_delta=cfg["delta"]
        )
    if cfg["plateau"]:
        loop = loop.reduce_lr_on_plateau(monitor, factor=0.5, patience=1, min_delta=cfg["delta"])
    if cfg["observe"]:
        loop = loop.observe(
            "iteration_completed",
            lambda s: records.append((s.epoch, s.iteration, repr(s.metrics))),
            {"every": cfg["observe"]},
        )
    if cfg["itlog"]:
        loop = loop.log(lambda s: f"{s.epoch}/{s.iteration} {s.metrics}\n", stream=log)
    if cfg["halt_epoch"] is not None:
        at = cfg["halt_epoch"]
        halt = lambda s: "halt_loop" if s.epoch == at else None  # noqa: E731
        loop = loop.handle_event("epoch_completed", halt)
    return loop.terminate_on_nan() if cfg["nan"] else loop


def _host(leaf: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def outcome(cfg: dict[str, Any], fuse: Any) -> tuple[Any, ...]:
    """What a user sees of the configuration's run(s) with `fuse`: ("ok", ...) or
    ("error", type name, message)."""
    records: list[Any] = []
    log = io.StringIO()
    options: dict[str, Any] = {"iterations": cfg["iters"], "fuse": fuse}
    if cfg["pop"] is not None:
        options["population"] = cfg["pop"]
    if cfg["mesh"]:
        options["mesh"] = Mesh(np.array(jax.devices()[: cfg["mesh"]]), ("data",))
    try:
        loop = _loop(cfg, records, log)
        data = _source(cfg["src"], cfg["n"], cfg["dseed"], cfg["bs"], cfg["shuffle"], cfg["drop"])
        state = loop.run(data, epochs=cfg["e1"] if cfg["resume"] else cfg["epochs"], **options)
        if cfg["resume"]:
            state = loop.run(data, state, epochs=cfg["epochs"], **options)
    except Exception as error:  # noqa: BLE001 - an error is an outcome to compare
        return ("error", type(error).__name__, str(error)[:300])
    leaves = [_host(leaf) for leaf in jax.tree.leaves(state.step_state)]
    seen = (state.history, state.metrics, state.event_counts, state.status, state.epoch)
    return ("ok", leaves, repr(seen), repr(records), log.getvalue())


def disagreement(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    """'' when two outcomes agree, else what differs."""
    if a[0] != b[0]:
        return f"{a[0]} vs {b[0]}: {a[1:] if a[0] == 'error' else b[1:]}"
    if a[0] == "error":
        return "" if a[1] == b[1] else f"errors {a[1:]} vs {b[1:]}"
    if len(a[1]) != len(b[1]):
        return "step state structure"
    for i, (p, q) in enumerate(zip(a[1], b[1], strict=True)):
        if p.dtype != q.dtype or p.shape != q.shape or not np.array_equal(p, q, equal_nan=True):
            return f"step state leaf {i}"
    for name, p, q in zip(("state", "observed", "log"), a[2:], b[2:], strict=True):
        if p != q:
            return f"{name}: {p[:400]} vs {q[:400]}"
    return ""


def draw(rng: random.Random, devices: int) -> dict[str, Any]:
    """One configuration; a mesh only where `devices` allows one."""
    epochs = rng.randint(1, 4)
    cfg = {
        "model": rng.choice(list(MODELS)),
        "opt": rng.choice(["adam", "sgd", "adamw"]),
        "seed": rng.randint(0, 3),
        "acc": rng.random() < 0.5,
        "n": rng.randint(9, 70),
        "dseed": rng.randint(0, 1000),
        "bs": rng.choice([4, 8, 16]),
        "src": rng.choice(["list", "callable", "arrays", "device", "device"]),
        "shuffle": rng.random() < 0.5,
        "drop": rng.random() < 0.3,
        "val": rng.choice([None, None, "list", "arrays", "device"]),
        "vn": rng.randint(5, 30),
        "vbs": rng.choice([4, 8]),
        "vfuse": rng.choice([False, True, 3]),
        "early": rng.random() < 0.4,
        "patience": rng.randint(1, 2),
        "restore": rng.random() < 0.5,
        "delta": rng.choice([0.0, 0.01, 1.0]),
        "plateau": rng.random() < 0.3,
        "observe": rng.choice([0, 0, 1, 3]),
        "log": rng.choice([0, 0, 1, 2, 5]),
        "itlog": rng.random() < 0.2,
        "halt_epoch": rng.choice([None, None, 0, 1, 2]),
        "nan": rng.random() < 0.3,
        "epochs": epochs,
        "iters": rng.choice([None, None, None, 1, 2, 3, 5]),
        "resume": rng.random() < 0.3,
        "e1": rng.randint(1, epochs),
        "fuse": rng.choice([2, 3, 5, True, "auto", "run", 100]),
        "pop": None,
        "mesh": 0,
    }
    # Host batches of two sizes are refused fused (DESIGN §4.2): draw them where they can
    # run, a short last batch on device-resident data only.
    if cfg["src"] in ("list", "callable") or (cfg["src"] == "arrays" and not cfg["drop"]):
        cfg["n"] = -(-cfg["n"] // cfg["bs"]) * cfg["bs"]
    if cfg["val"] in ("list", "arrays") and cfg["vfuse"]:
        cfg["vn"] = -(-cfg["vn"] // cfg["vbs"]) * cfg["vbs"]
    cfg["n"] = max(cfg["n"], cfg["bs"])
    roll = rng.random()
    if devices >= 2 and roll < 0.25:
        cfg["mesh"] = 4 if devices >= 4 and rng.random() < 0.5 else 2
        cfg["drop"] = True  # a mesh splits every batch: all of one size
    elif roll < 0.5:
        sweep = {"learning_rate": [1e-3, 3e-2]}
        # An nnx or equinox model is built with its weights: members differ by a rate.
        seeded = cfg["model"] not in ("nnx", "eqx")
        cfg["pop"] = rng.choice([2, 3, sweep]) if seeded else sweep
        cfg["observe"] = 0
    return cfg


def check(cfg: dict[str, Any]) -> tuple[str, str]:
    """`(verdict, detail)`: "ok", "refused" (fused FusionError, by design) or "mismatch"."""
    reference, fused = outcome(cfg, False), outcome(cfg, cfg["fuse"])
    why = disagreement(reference, fused)
    if why and fused[:2] == ("error", "FusionError") and reference[0] == "ok":
        return "refused", fused[2][:120]
    if not why and cfg["src"] == "device" and not cfg["mesh"]:
        why = disagreement(reference, outcome({**cfg, "src": "arrays"}, False))
        why = f"device vs host source: {why}" if why else ""
    agreed = reference[0] if reference[0] == "ok" else f"both raise {reference[1]}"
    return ("mismatch", why) if why else ("ok", agreed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="first configuration's seed")
    parser.add_argument("--count", type=int, default=100, help="configurations to draw")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # a short batch's compile warning, and the like
    devices, mismatches = len(jax.devices()), 0
    for k in range(args.seed, args.seed + args.count):
        cfg = draw(random.Random(k), devices)
        began = time.perf_counter()
        verdict, detail = check(cfg)
        if verdict == "mismatch" and check(cfg)[0] == "mismatch":  # reproducible
            mismatches += 1
            print(f"MISMATCH seed {k}: {detail}\n  {json.dumps(cfg)}", flush=True)
            continue
        took = time.perf_counter() - began
        print(
            f"{verdict:8s} seed {k} {took:5.1f}s {cfg['model']} {cfg['src']} "
            f"fuse={cfg['fuse']} pop={cfg['pop']} mesh={cfg['mesh']} {detail}",
            flush=True,
        )
    print(f"{args.count} configurations, {mismatches} mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
