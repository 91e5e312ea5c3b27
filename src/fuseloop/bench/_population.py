"""`fuseloop bench --population`: N members in one run, against N sequential runs and
against a hand-written `jit(vmap(scan))` floor.

Every system trains the same N members of one model (mlp-tiny, or `mlp-demo`: the demo's
MLP, 64 -> 128 -> 10 as on digits; seeds 0..N-1, the named "adam", batch 32, 100 batches an
epoch, unshuffled device-resident data) for the same epochs, from the
same initial parameters. One round times each system once, in rotated order, so drifting
machine load is shared; compilation and a warm-up round are excluded. Medians are
reported, with the median of the per-round paired ratios.

Example:
    >>> from fuseloop.bench._population import population_benchmark
    >>> population_benchmark(members=2, rounds=1, epochs=1)  # doctest: +SKIP
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

from .._factories import trainer
from .._optim import resolve_optimizer
from ..data import arrays
from ._output import write_json
from ._workload import MODELS, ModelSpec, Workload

__all__ = [
    "POPULATION_MODELS",
    "population_benchmark",
    "population_main",
    "population_markdown",
    "population_models",
]

# The models a population is timed on: the tiny MLP, and the demo's MLP ([128, 10] on the
# 64 pixels of a digits image).
POPULATION_MODELS: dict[str, ModelSpec] = {
    "mlp-tiny": MODELS["mlp-tiny"],
    "mlp-demo": ModelSpec("mlp-demo", 64, (128, 10)),
}

_LOSS = "sparse_categorical_cross_entropy"


def _trainer(w: Workload, seed: int) -> Any:
    return trainer(w.module, _LOSS, "adam", seed=seed)


def _population(w: Workload, data: Any, members: int, epochs: int, fuse: Any) -> Callable:
    loop = _trainer(w, 0)

    def run() -> Any:
        state = loop.run(data, epochs=epochs, fuse=fuse, population=members)
        return jax.block_until_ready(state.params)

    return run


def _sequential(w: Workload, data: Any, members: int, epochs: int, fuse: int) -> Callable:
    loops = [_trainer(w, seed) for seed in range(members)]

    def run() -> Any:
        params = [loop.run(data, epochs=epochs, fuse=fuse).params for loop in loops]
        return jax.block_until_ready(params)

    return run


def _floor(w: Workload, members: int, epochs: int) -> Callable:
    """`jit(vmap(scan))`: every member's epochs in one program, data on the device, the
    members initialized as fuseloop's trainer does (per seed: split the key, init)."""
    tx = resolve_optimizer("adam")
    xs, ys = (jnp.asarray(a) for a in w.stacked())

    def init(seed: Any) -> Any:
        init_key, _ = jax.random.split(jax.random.PRNGKey(seed))
        params = w.module.init(init_key, xs[0])["params"]
        return params, tx.init(params)

    def member(params: Any, opt_state: Any) -> Any:
        def body(carry: Any, batch: Any) -> Any:
            params, opt_state = carry
            x, y = batch

            def loss(p: Any) -> Any:
                logits = w.module.apply({"params": p}, x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        def epoch(carry: Any, _: Any) -> Any:
            return lax.scan(body, carry, (xs, ys))

        (params, _), losses = lax.scan(epoch, (params, opt_state), None, length=epochs)
        return params, losses

    program = jax.jit(lambda seeds: jax.vmap(lambda s: member(*init(s)))(seeds))
    seeds = jnp.arange(members, dtype=jnp.int32)

    def run() -> Any:
        params, _ = program(seeds)
        return jax.block_until_ready(params)

    return run


def _agree(population: Any, floor: Any) -> float:
    """The largest relative difference between the population's and the floor's params
    (a guard: both must train the same members)."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(population), jax.tree.leaves(floor), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        worst = max(worst, float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12)))
    return worst


def population_benchmark(
    members: int = 32,
    epochs: int = 3,
    rounds: int = 5,
    fuse: int = 32,
    log: Callable[[str], None] = lambda message: None,
    model: str = "mlp-tiny",
) -> dict[str, Any]:
    """Times the population, the sequential runs and the floor in interleaved rounds.

    `model` is a name in `POPULATION_MODELS`.

    Returns:
        `{"meta", "seconds": {system: [per round]}, "median_s", "ratios"}`; ratios are
        medians of per-round paired ratios.
    """
    if model not in POPULATION_MODELS:
        raise ValueError(f"model={model!r}: the population bench knows {list(POPULATION_MODELS)}")
    w = Workload(POPULATION_MODELS[model])
    data = arrays(w.x, w.y, batch_size=w.batch_size, shuffle=False, device=True)
    systems = {
        "population": _population(w, data, members, epochs, fuse),
        "population_run": _population(w, data, members, epochs, "run"),  # one dispatch
        "sequential": _sequential(w, data, members, epochs, fuse),
        "floor": _floor(w, members, epochs),
    }
    results = {name: run() for name, run in systems.items()}  # compile and warm up
    drift = max(
        _agree(results["population"]["params"], results["floor"]),
        _agree(results["population_run"]["params"], results["floor"]),
    )
    if drift > 1e-4:
        raise RuntimeError(f"population and floor trained different params ({drift:.2e})")
    log(f"warm; population vs floor params agree to {drift:.1e}")
    seconds, cpu = _rounds(systems, rounds, log)
    return {
        "meta": {
            "model": model,
            "members": members,
            "epochs": epochs,
            "rounds": rounds,
            "fuse": fuse,
            "batches_per_epoch": w.n_batches,
            "backend": jax.default_backend(),
            "params_agreement": drift,
        },
        "seconds": seconds,
        "median_s": {name: statistics.median(v) for name, v in seconds.items()},
        "ratios": _ratios(seconds),
        "cpu_seconds": cpu,
        "median_cpu_s": {name: statistics.median(v) for name, v in cpu.items()},
        "cpu_ratios": _ratios(cpu),
    }


def _rounds(
    systems: dict[str, Callable], rounds: int, log: Callable[[str], None]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each system once per round, in rotated order: wall seconds and CPU seconds (the
    process's, all threads: on a machine shared with other jobs it moves less than the
    wall time, since waiting for a core does not count)."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    order = list(systems)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            began, began_cpu = time.perf_counter(), time.process_time()
            systems[name]()
            seconds[name].append(time.perf_counter() - began)
            cpu[name].append(time.process_time() - began_cpu)
        log(
            f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in seconds.items())
        )
    return seconds, cpu


def _ratios(seconds: dict[str, list[float]]) -> dict[str, float]:
    """Medians of the per-round paired ratios."""
    pairs = list(zip(seconds["population"], seconds["sequential"], seconds["floor"], strict=True))
    ratios = {
        "sequential_over_population": statistics.median(s / p for p, s, _ in pairs),
        "population_over_floor": statistics.median(p / f for p, _, f in pairs),
    }
    if "population_run" in seconds:
        whole = zip(seconds["population_run"], seconds["floor"], strict=True)
        ratios["population_run_over_floor"] = statistics.median(p / f for p, f in whole)
    return ratios


def population_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    meta, median = report["meta"], report["median_s"]
    cpu = report.get("median_cpu_s", {name: float("nan") for name in median})
    lines = [
        f"## Populations: {meta['members']} members of {meta['model']}, {meta['epochs']} "
        f"epochs, fuse={meta['fuse']} ({meta['backend']}, medians of {meta['rounds']} "
        f"interleaved rounds)",
        "",
        "| system | median wall s | median CPU s |",
        "|---|---:|---:|",
        f"| population=N, one run | {median['population']:.3f} | {cpu['population']:.3f} |",
        f"| population=N, fuse='run' (one dispatch) | {median['population_run']:.3f} | "
        f"{cpu['population_run']:.3f} |",
        f"| N sequential fused runs | {median['sequential']:.3f} | {cpu['sequential']:.3f} |",
        f"| floor: jit(vmap(scan)) | {median['floor']:.3f} | {cpu['floor']:.3f} |",
        "",
    ]
    for label, key in (("wall", "ratios"), ("CPU", "cpu_ratios")):
        if key in report:
            ratios = report[key]
            lines.append(
                f"{label}: sequential / population "
                f"{ratios['sequential_over_population']:.2f}x (target >= 3x); population / "
                f"floor {ratios['population_over_floor']:.2f}x (target <= 1.15x); "
                f"fuse='run' / floor {ratios['population_run_over_floor']:.2f}x"
            )
    return "\n".join(lines)


def population_models(models: str | None, parser: argparse.ArgumentParser) -> list[str]:
    """The models `--models` names for `--population` (default mlp-tiny); a name that is
    not one of POPULATION_MODELS is a usage error naming the ones there are."""
    names = [m.strip() for m in (models or "mlp-tiny").split(",") if m.strip()]
    unknown = [m for m in names if m not in POPULATION_MODELS]
    if unknown:
        parser.error(
            f"--models {','.join(unknown)}: with --population, pick from "
            f"{','.join(POPULATION_MODELS)}"
        )
    return names


def population_main(
    members: int,
    names: list[str],
    reps: int,
    json_path: str | None,
    log: Callable[[str], None],
    command: str,
) -> int:
    """`fuseloop bench --population [--members N] [--models M,...] [--reps R] [--json PATH]`
    over the models `names` (`population_models`); `command` is recorded in each report."""
    reports = [
        population_benchmark(members=members, rounds=reps, log=log, model=name) for name in names
    ]
    for report in reports:
        report["meta"]["command"] = command
        print(population_markdown(report))
    if json_path:  # one model: its report; several: {"models": {name: report}}
        data = (
            reports[0] if len(reports) == 1 else {"models": dict(zip(names, reports, strict=True))}
        )
        write_json(data, json_path)
        log(f"wrote {json_path}")
    return 0
