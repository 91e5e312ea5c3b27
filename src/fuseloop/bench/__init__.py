"""`fuseloop bench`: fuseloop against the floor and its peers, side by side, in one process.

For each model (MLPs of ~1.1K, ~25K and ~1.2M parameters, and with `--zoo` a CNN, a causal
transformer and a GRU; batch 32, 100 batches an epoch)
every system trains one epoch per repetition, repetitions interleaved so drifting machine
load is shared, compilation and a warm-up epoch excluded. A timing is only reported once
its guards pass (see `_guards`): right device, no NaN, fused == unfused bitwise, reference
loops training what fuseloop trains. Peers that cannot run are listed as skipped.

From a shell: `fuseloop bench --quick --models mlp-tiny` (a minute), `fuseloop bench
--quick --zoo` (the zoo as well; several minutes). See `main` for a Python example.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from .._arg_types import is_int
from ..engine.signals import AbortOnSignal
from ._harness import RATIOS, compile_vs_k, cross_check, measure, ratios, targets
from ._options import check_modes
from ._output import machine_info, markdown, unplottable, unwritable, write_json, write_plot
from ._overlap import overlap
from ._plan import Plan, mlp_plan, zoo_plan
from ._workload import MODELS, ModelSpec, Workload
from ._zoo import ZOO, ZooSpec, ZooWorkload, zoo_summary

__all__ = ["main", "run_benchmark", "select_models", "MODELS", "ModelSpec", "ZOO", "ZooSpec"]

SWEEP_KS = (1, 4, 8, 16, 32, 64)
COMPILE_KS = (8, 256)
MAIN_FUSE = 32


def _plan(w: Workload | ZooWorkload, sweep_ks: Sequence[int], peers: bool) -> Plan:
    """(key, label, factory) for every system to time on workload `w`, in table order."""
    if isinstance(w, ZooWorkload):
        return zoo_plan(w, peers, MAIN_FUSE)
    return mlp_plan(w, sweep_ks, peers, MAIN_FUSE)


def _sweep(model: str, results: dict[str, Any], ks: Sequence[int]) -> dict[str, Any]:
    unfused = results["fl_unfused"].median_us
    rows = []
    for k in ks:
        result = results.get(f"fl_fuse{k}")
        median = result.median_us if result is not None else None
        rows.append(
            {
                "K": k,
                "median_us": median,
                "min_us": result.min_us if result is not None else None,
                "status": result.status if result is not None else "missing",
                "speedup": unfused / median if unfused and median else None,
            }
        )
    return {
        "model": model,
        "unfused_us": unfused,
        "rows": rows,
        "floor_transfer_us": results["floor_transfer"].median_us,
    }


def _epochs_per_sample(w: Workload | ZooWorkload, target_s: float, least: int) -> int:
    """Epochs per timed sample, so a sample lasts about `target_s` (one floor epoch timed).

    An epoch longer than `LONG_EPOCH_S` is a sample of its own: it already spans many
    scheduler slices, and a second one would only lengthen the run.
    """
    from ._systems import Floor

    floor = Floor(w, transfer=True)
    floor.setup()
    seconds = min(floor.sample(1 if isinstance(w, ZooWorkload) else 2).seconds)
    if seconds >= LONG_EPOCH_S:
        return 1
    return max(least, min(20, round(target_s / max(seconds, 1e-6))))


LONG_EPOCH_S = 0.5
Spec = ModelSpec | ZooSpec


def _resolve(models: Sequence[str | Spec]) -> list[Spec]:
    specs: list[Spec] = []
    for model in models:
        if isinstance(model, (ModelSpec, ZooSpec)):
            specs.append(model)
        elif model in MODELS or model in ZOO:
            specs.append(MODELS.get(model) or ZOO[model])
        else:
            raise ValueError(
                f"models: {model!r} is not a benchmark model; accepted values: "
                f"{', '.join([*MODELS, *ZOO])}"
            )
    return specs


def _workload(spec: Spec, batch_size: int, n_batches: int) -> Workload | ZooWorkload:
    if isinstance(spec, ZooSpec):
        return ZooWorkload(spec, batch_size=batch_size, n_batches=n_batches)
    return Workload(spec, batch_size=batch_size, n_batches=n_batches)


def run_benchmark(
    models: Sequence[str | Spec] = tuple(MODELS),
    *,
    reps: int = 10,
    quick: bool = False,
    batch_size: int = 32,
    n_batches: int = 100,
    peers: bool = True,
    sweep_model: str | None = "mlp-small",
    sweep_ks: Sequence[int] = SWEEP_KS,
    compile_ks: Sequence[int] = COMPILE_KS,
    overlap_model: str | None = "mlp-large",
    target_s: float = 0.02,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Runs the benchmark and returns every figure as a JSON-ready dict.

    Args:
        models: Names from `MODELS` or `ZOO`, or `ModelSpec`s / `ZooSpec`s.
        reps: Timed, interleaved rounds; each runs every system for a sample of epochs.
        quick: Recorded in the output (the caller chose fewer reps).
        batch_size, n_batches: The epoch's shape.
        peers: Include Keras and PyTorch.
        sweep_model: Model for the chunk-size sweep and the compile-vs-K figures (None: no
            sweep); if it is not among `models`, the sweep is skipped.
        sweep_ks, compile_ks: Chunk sizes for those.
        overlap_model: Model for the slow-source line (a source that takes the fused step
            time to produce each batch); None or absent from `models`: no such line.
        target_s: About how long one sample lasts: a model whose epoch is short gets
            more epochs per sample (2 to 20; 1 to 20 when `quick`), so scheduler noise
            averages out.
        log: Progress messages.

    Example:
        >>> report = run_benchmark(["mlp-tiny"], reps=1, quick=True, peers=False,
        ...                        sweep_model=None, overlap_model=None)
        >>> systems = report["models"]["mlp-tiny"]["systems"]
        >>> systems["floor"]["status"], report["meta"]["batches_per_epoch"]
        ('ok', 100)
    """
    if not is_int(reps) or reps < 1:
        raise ValueError(f"reps={reps!r} must be a positive int")
    specs = _resolve(models)
    began = time.perf_counter()
    out = _report_frame(reps, quick, batch_size, n_batches)
    for spec in specs:
        w = _workload(spec, batch_size, n_batches)
        log(f"{spec.name} ({w.n_params:,} params)")
        ks = sweep_ks if spec.name == sweep_model else ()
        results, epochs = _measure(w, _plan(w, ks, peers), reps, 1 if quick else 2, target_s, log)
        out["models"][spec.name] = _model_entry(w, results, epochs)
        if ks:
            _add_sweep(out, spec.name, w, results, ks, compile_ks, log)
        if spec.name == overlap_model:
            log("  slow source: data time vs compute time")
            out["overlap"] = overlap(w, min(reps, 3), MAIN_FUSE)
    out["targets"] = targets({name: entry["ratios"] for name, entry in out["models"].items()})
    out["meta"]["total_s"] = round(time.perf_counter() - began, 1)
    return out


def _measure(
    w: Workload | ZooWorkload,
    plan: Plan,
    reps: int,
    least: int,
    target_s: float,
    log: Callable[[str], None],
) -> tuple[dict[str, Any], int]:
    """Times every system of `plan` on `w` and checks they trained alike: the results, and
    the epochs per sample (at least `least`)."""
    epochs = _epochs_per_sample(w, target_s, least)
    log(f"  {epochs} epoch(s) per sample")
    results, params, references = measure(plan, reps, w.n_batches, epochs, log)
    cross_check(results, params, references)
    return results, epochs


def _report_frame(reps: int, quick: bool, batch_size: int, n_batches: int) -> dict[str, Any]:
    """The report's settings and machine, with an empty place for every figure."""
    return {
        "meta": {
            "reps": reps,
            "quick": quick,
            "batch_size": batch_size,
            "batches_per_epoch": n_batches,
            "machine": machine_info(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "timing": "per-iteration microseconds = one epoch's wall time / batches; every "
            "epoch of every sample is a data point, but a fuseloop sample is one (the mean "
            "of its epochs: the next epoch's first chunk is launched ahead of the read); "
            "fuseloop and Keras time epochs 1..n of an (n+1)-epoch run "
            "(state.stats['epoch_time'], on_epoch_begin/end), the others start each epoch "
            "from the initial parameters",
        },
        "models": {},
        "ratio_definitions": [list(r) for r in RATIOS],
        "targets": [],
        "sweep": None,
        "compile_vs_k": None,
        "compile_model": None,
        "overlap": None,
    }


def _model_entry(w: Workload | ZooWorkload, results: dict[str, Any], epochs: int) -> dict[str, Any]:
    """One model's figures: the main systems (not the sweep's chunk sizes) and the ratios."""
    main_keys = [
        key
        for key in results
        if not key.startswith("fl_fuse")
        or key in (f"fl_fuse{MAIN_FUSE}", f"fl_fuse{MAIN_FUSE}_resident", "fl_fuseauto")
    ]
    entry = {
        **w.describe(),
        "epochs_per_sample": epochs,
        "systems": {key: results[key].to_json() for key in main_keys},
        "ratios": ratios(results),
        "ratios_of_minima": ratios(results, "min_us"),
    }
    if isinstance(w, ZooWorkload):
        entry["zoo"] = zoo_summary(results, MAIN_FUSE)
    return entry


def _add_sweep(
    out: dict[str, Any],
    model: str,
    w: Workload | ZooWorkload,
    results: dict[str, Any],
    ks: Sequence[int],
    compile_ks: Sequence[int],
    log: Callable[[str], None],
) -> None:
    """The chunk-size sweep's figures on `model`, and its compile time against K."""
    out["sweep"] = _sweep(model, results, ks)
    out["sweep"]["systems"] = {f"fl_fuse{k}": results[f"fl_fuse{k}"].to_json() for k in ks}
    log(f"  compile time against K {tuple(compile_ks)}")
    out["compile_vs_k"] = compile_vs_k(w, tuple(compile_ks))
    out["compile_model"] = model


def _diagnostics(specs: list[Spec], fuse: Any, batch: int, n: int, reps: int) -> dict[str, Any]:
    from .. import diagnostics, trainer

    reports = {}
    for spec in specs:
        w = _workload(spec, batch, n)
        loop = trainer(w.module, "sparse_categorical_cross_entropy", w.tx)
        reports[spec.name] = diagnostics.report(loop, w.batches, fuse=fuse, reps=reps)
    return reports


def select_models(models: str | None, zoo: bool) -> list[str]:
    """The model names `--models` and `--zoo` select: the comma-separated `models` (the
    MLPs when None and no `--zoo`), then the zoo models not already named.

    Example:
        >>> select_models("mlp-tiny", zoo=True)
        ['mlp-tiny', 'cnn', 'transformer', 'gru']
        >>> select_models(None, zoo=False)
        ['mlp-tiny', 'mlp-small', 'mlp-large']
    """
    names = [m.strip() for m in (models or "").split(",") if m.strip()]
    if models is None and not zoo:
        names = list(MODELS)
    return names + [name for name in ZOO if zoo and name not in names]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuseloop bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 repetitions instead of 10 (1.5-3 minutes on 2 cores)",
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per system")
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated models among {', '.join([*MODELS, *ZOO])} "
        f"(default: the MLPs, or none with --zoo)",
    )
    parser.add_argument(
        "--zoo",
        action="store_true",
        help=f"add the model zoo ({', '.join(ZOO)}): the floor, fuseloop, "
        f"the plain loop and Keras per model",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG to PATH")
    parser.add_argument(
        "--report",
        action="store_true",
        help="print fl.diagnostics.report(fuse=32) per model (timing --reps epochs of "
        "each kind: 3, 1 with --quick), no benchmark",
    )
    parser.add_argument("--no-peers", action="store_true", help="leave out Keras and PyTorch")
    parser.add_argument(
        "--population",
        action="store_true",
        help="instead: N members in one run (population=N) against N sequential runs and a "
        "jit(vmap(scan)) floor, 3 epochs; --models mlp-tiny (default), mlp-demo or both",
    )
    parser.add_argument(
        "--members", type=int, default=None, help="population members (with --population; 32)"
    )
    parser.add_argument(
        "--whole-run",
        action="store_true",
        help="only the whole-run workload (digits, 20 epochs, validation and early "
        "stopping): fuse='run' against its one-jit floor and the per-epoch dispatch",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`fuseloop bench [--quick] [--json PATH] [--plot PATH] [--report] [--models ...]
    [--zoo] [--reps N]`; prints markdown to stdout, progress to stderr. Returns the exit
    status.

    Example:
        >>> import contextlib, io, json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "bench.json")
        >>> with contextlib.redirect_stdout(io.StringIO()) as markdown:
        ...     status = main(["--quick", "--models", "mlp-tiny", "--no-peers", "--reps", "1",
        ...                    "--json", path])
        >>> status, "| fuseloop fuse=32 |" in markdown.getvalue(), "models" in json.load(open(path))
        (0, True, True)
    """
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    check_modes(parser, args)
    reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        # Checked before minutes of timing, not after: the folder is made, as demo's is.
        problem = unwritable(path) or (unplottable(path) if option == "--plot" and path else None)
        if problem:
            parser.error(f"{option} {path}: {problem}")
    # Runs inside the benchmark halt on a first signal and the benchmark would go on to the
    # next system; as the outermost guard, this one stops it instead.
    with AbortOnSignal():
        return _main(args, parser, argv, reps)


def _main(args: Any, parser: Any, argv: Sequence[str] | None, reps: int) -> int:
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    command = "fuseloop bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.population:  # its own models (POPULATION_MODELS)
        from ._population import population_main, population_models

        names = population_models(args.models, parser)
        return population_main(args.members, names, reps, args.json, log, command)
    try:
        specs = _resolve(select_models(args.models, args.zoo))
    except ValueError as error:
        parser.error(str(error).replace("models: ", f"--models={args.models}: ", 1))
    if args.whole_run:
        from ._whole_run import whole_run_benchmark, whole_run_markdown

        result = whole_run_benchmark(reps, log=log)
        print(whole_run_markdown(result))
        if args.json:
            write_json(result, args.json)
        return 0
    if args.report:
        timed = args.reps or (1 if args.quick else 3)  # epochs of each kind it times
        reports = _diagnostics(specs, MAIN_FUSE, 32, 100, timed)
        for name, report in reports.items():
            print(f"## {name}\n\n```\n{report}\n```\n")
        if args.json:
            write_json(
                {name: {"text": str(r), **r.__dict__} for name, r in reports.items()}, args.json
            )
        return 0
    report = run_benchmark(specs, reps=reps, quick=args.quick, peers=not args.no_peers, log=log)
    report["meta"]["command"] = command
    print(markdown(report))
    if args.json:
        write_json(report, args.json)
        log(f"wrote {args.json}")
    if args.plot:
        problem = write_plot(report, args.plot)
        log(f"plot not written: {problem}" if problem else f"wrote {args.plot}")
    log(f"done in {report['meta']['total_s']}s")
    return 0
