"""`fuseloop bench --whole-run`: a whole training run against its hand-written floor.

The workload: digits (1437 train / 360 held-out), `fl.models.mlp([128, 10])`, Adam 1e-3,
batch 32 (44 training batches an epoch) and 12 validation batches of 30, 20 epochs, data on
the device, validation every epoch and early stopping on `validation_loss`. Three systems,
timed in interleaved rounds (compilation and a warm-up run excluded), wall and CPU time,
medians and minima reported:

* the floor: one `jax.jit` running the whole run (the model's initialization from the seed,
  then a `fori_loop` over the 20 epochs: on-device permutation, `scan` over the training
  batches, `scan` over the validation batches, the epoch's metrics into a history buffer,
  read once at the end). It does fuseloop's arithmetic: the bench checks that its final
  parameters equal fuseloop's bit for bit;
* fuseloop `fuse="run"`: the whole run in one dispatch (docs/design.md §9);
* fuseloop's per-epoch dispatch: `fuse=44` (one chunk per epoch), validation on the host
  with `validate(..., fuse=True)` after each epoch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["whole_run_benchmark", "whole_run_markdown"]

EPOCHS, BATCH, VAL_BATCH = 20, 32, 30


def _digits() -> tuple[np.ndarray, ...]:
    from .._demo import digits_split

    return digits_split()


def _fuseloop(fuse: Any) -> Callable[[], Any]:
    import fuseloop as fl

    x, y, vx, vy = _digits()
    train = fl.data.arrays(x, y, batch_size=BATCH, seed=0, device=True)
    val = fl.data.arrays(vx, vy, batch_size=VAL_BATCH, shuffle=False, device=True)
    model = fl.models.mlp([128, 10])
    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-3))
        .metric("accuracy")
        .validate(model, val, fuse=True)
        .early_stop("validation_loss", patience=5)
    )

    def run() -> Any:
        state = loop.run(train, epochs=EPOCHS, fuse=fuse)
        if len(state.history) != EPOCHS:  # the floor trains every epoch: so must this
            raise RuntimeError(f"fuse={fuse!r} ran {len(state.history)} epochs, not {EPOCHS}")
        return state

    return run


def _floor() -> Callable[[], Any]:
    import fuseloop as fl

    x, y, vx, vy = (jnp.asarray(a) for a in _digits())
    model = fl.models.mlp([128, 10])
    tx = optax.adam(1e-3)
    steps, val_steps = x.shape[0] // BATCH, vx.shape[0] // VAL_BATCH
    vx = vx[: val_steps * VAL_BATCH].reshape(val_steps, VAL_BATCH, -1)
    vy = vy[: val_steps * VAL_BATCH].reshape(val_steps, VAL_BATCH)

    def metrics(p: Any, xb: Any, yb: Any) -> tuple[Any, Any]:
        logits: Any = model.apply(p, xb)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
        return loss, (jnp.argmax(logits, -1) == yb).mean()

    def train_step(carry: Any, rows: Any) -> tuple[Any, Any]:
        p, o = carry
        (loss, acc), grads = jax.value_and_grad(metrics, has_aux=True)(p, x[rows], y[rows])
        updates, o = tx.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), jnp.stack([loss, acc])

    def epoch(e: Any, carry: Any) -> Any:
        p, o, history = carry
        order = jax.random.permutation(jax.random.fold_in(jax.random.PRNGKey(0), e), x.shape[0])
        rows = order[: steps * BATCH].reshape(steps, BATCH)
        (p, o), train = jax.lax.scan(train_step, (p, o), rows)
        _, val = jax.lax.scan(lambda c, b: (c, jnp.stack(metrics(p, *b))), None, (vx, vy))
        row = jnp.concatenate([train.mean(0), val.mean(0)])
        return p, o, history.at[e].set(row)

    @jax.jit
    def whole() -> Any:
        # The trainer's initialization, as fuseloop's run does it (seed 0's first key).
        p = model.init(jax.random.split(jax.random.PRNGKey(0))[0], x[:BATCH])
        carry = (p, tx.init(p), jnp.zeros((EPOCHS, 4), jnp.float32))
        return jax.lax.fori_loop(0, EPOCHS, epoch, carry)

    def run() -> Any:
        params, _, history = whole()
        np.asarray(history)  # the history read to the host, once
        return params

    return run


SYSTEMS = {
    "floor": (
        "floor: one jit, init + fori_loop over 20 epochs (scan train, scan validation)",
        _floor,
    ),
    "fl_run": (
        "fuseloop fuse='run' (validate + early_stop on the device)",
        lambda: _fuseloop("run"),
    ),
    "fl_epoch": (
        "fuseloop fuse=44: one dispatch per epoch, validation on the host",
        lambda: _fuseloop(44),
    ),
}


def whole_run_benchmark(reps: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Times the systems in `reps` interleaved rounds: wall and CPU seconds, the two ratios
    of medians and of minima, and whether the floor's parameters equal fuseloop's.
    """
    runs = {key: factory() for key, (_, factory) in SYSTEMS.items()}
    for key, run in runs.items():  # compile and warm up
        run()
        log(f"warmed up {key}")
    times: dict[str, list[float]] = {key: [] for key in runs}
    cpu: dict[str, list[float]] = {key: [] for key in runs}
    for r in range(reps):
        for key, run in runs.items():
            began, began_cpu = time.perf_counter(), time.process_time()
            run()
            times[key].append(time.perf_counter() - began)
            cpu[key].append(time.process_time() - began_cpu)
        log(f"round {r + 1}/{reps}")
    state = runs["fl_run"]()
    return {
        "reps": reps,
        "seconds": times,
        "cpu_seconds": cpu,
        "median_s": {key: statistics.median(t) for key, t in times.items()},
        "min_s": {key: min(t) for key, t in times.items()},
        "median_cpu_s": {key: statistics.median(t) for key, t in cpu.items()},
        **_ratios(times, cpu),
        "dispatches_run": state.stats["dispatches"],
        "floor_equals_fuseloop": _same_params(runs["floor"](), state.step_state["params"]),
    }


def _ratios(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, float]:
    med = {key: statistics.median(t) for key, t in times.items()}
    low = {key: min(t) for key, t in times.items()}
    med_cpu = {key: statistics.median(t) for key, t in cpu.items()}
    return {
        "run_over_floor": med["fl_run"] / med["floor"],
        "epoch_over_run": med["fl_epoch"] / med["fl_run"],
        "run_over_floor_min": low["fl_run"] / low["floor"],
        "epoch_over_run_min": low["fl_epoch"] / low["fl_run"],
        "run_over_floor_cpu": med_cpu["fl_run"] / med_cpu["floor"],
        "epoch_over_run_cpu": med_cpu["fl_epoch"] / med_cpu["fl_run"],
    }


def _same_params(floor: Any, fuseloop: Any) -> bool:
    """Whether the floor trained the same parameters as fuseloop, bit for bit."""
    if str(jax.tree.structure(floor)) != str(jax.tree.structure(fuseloop)):
        return False
    pairs = zip(jax.tree.leaves(floor), jax.tree.leaves(fuseloop), strict=True)
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


def whole_run_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"## Whole run: digits, MLP [128, 10], {EPOCHS} epochs, validation + early stopping",
        "",
        f"{result['reps']} interleaved rounds (one round: one run per system)",
        "",
        "| system | median s | min s | median CPU s |",
        "|---|---|---|---|",
    ]
    for key, (label, _) in SYSTEMS.items():
        lines.append(
            f"| {label} | {result['median_s'][key]:.4f} | {result['min_s'][key]:.4f} "
            f"| {result['median_cpu_s'][key]:.4f} |"
        )
    r = result
    lines += [
        "",
        f"fuse='run' / floor: {r['run_over_floor']:.2f}x median, {r['run_over_floor_min']:.2f}x "
        f"min, {r['run_over_floor_cpu']:.2f}x CPU (target <= 1.10x); per-epoch / fuse='run': "
        f"{r['epoch_over_run']:.2f}x median, {r['epoch_over_run_min']:.2f}x min, "
        f"{r['epoch_over_run_cpu']:.2f}x CPU (target >= 1.6x); fuse='run' dispatches: "
        f"{r['dispatches_run']}; floor params == fuseloop params: {r['floor_equals_fuseloop']}",
    ]
    return "\n".join(lines)
