"""What the benchmark prints and writes: a markdown table, a JSON file and a PNG."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "markdown", "unplottable", "unwritable", "write_json", "write_plot"]

_PACKAGES = ("fuseloop", "jax", "jaxlib", "optax", "flax", "numpy", "keras", "torch")


def machine_info() -> dict[str, Any]:
    """The machine, the JAX devices and the library versions the figures came from."""
    import jax

    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": sys.version.split()[0],
        "jax_backend": jax.default_backend(),
        # JAX_CPU_ENABLE_ASYNC_DISPATCH=false runs programs on the calling thread where it
        # can: less overlap of a chunk's stacking with the chunk before (docs/performance.md).
        "cpu_dispatch": "async" if jax.config.read("jax_cpu_enable_async_dispatch") else "inline",
        "jax_devices": [str(d) for d in jax.devices()],
        "versions": versions,
    }


def _cell(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {result['reason']}"
    cell = f"{result['median_us']:.1f} ({result['min_us']:.1f})"
    chosen = sorted(set(result["info"].get("chunk_size", [])))
    if result["label"].endswith("'auto'") and chosen:
        cell += f" K={','.join(map(str, chosen))}"
    return cell


def _ratio(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    """The benchmark as markdown tables (per-iteration times, ratios, sweep, compile)."""
    models = report["models"]
    names = list(models)
    meta = report["meta"]
    epochs = ", ".join(f"{models[n].get('epochs_per_sample', 1)} ({n})" for n in names)
    out = [
        f"Per-iteration time in microseconds, median (min) over {meta['reps']} interleaved "
        f"rounds of {epochs} epochs per system; batch {meta['batch_size']}, "
        f"{meta['batches_per_epoch']} batches "
        f"an epoch, steady state (compilation excluded); {meta['machine']['cpus_usable']} "
        f"CPU cores, JAX on {meta['machine']['jax_backend']}"
        + (
            f" ({meta['machine']['cpu_dispatch']} dispatch)."
            if meta["machine"].get("cpu_dispatch") and meta["machine"]["jax_backend"] == "cpu"
            else "."
        )
        + (" Quick run: few repetitions, expect noise." if meta["quick"] else ""),
        "",
    ]
    header = ["system"] + [f"{n} ({models[n]['params']:,} params)" for n in names]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys: list[str] = []
    for n in names:
        keys += [k for k in models[n]["systems"] if k not in keys]
    for key in keys:
        label = next(
            models[n]["systems"][key]["label"] for n in names if key in models[n]["systems"]
        )
        cells = [
            _cell(models[n]["systems"][key]) if key in models[n]["systems"] else "-" for n in names
        ]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| ratio (median times) | " + " | ".join(names) + " |",
        "|" + "---|" * (len(names) + 1),
    ]
    for name, _, _, meaning in report["ratio_definitions"]:
        values = [models[n]["ratios"].get(name) for n in names]
        if all(value is None for value in values):
            continue  # a ratio of systems none of these models ran (zoo: no torch)
        cells = [_ratio(value) for value in values]
        out.append(f"| {name}: {meaning} | " + " | ".join(cells) + " |")
    if report["targets"]:
        out += ["", "| target | value | met |", "|---|---|---|"]
        for t in report["targets"]:
            met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
            out.append(
                f"| {t['model']} {t['ratio']} {t['target']} | {_ratio(t['value'])} | {met} |"
            )
    out += (
        _zoo_lines(report) + _sweep_lines(report) + _compile_lines(report) + _overlap_lines(report)
    )
    return "\n".join(out) + "\n"


def _zoo_lines(report: dict[str, Any]) -> list[str]:
    zoo = {name: m["zoo"] for name, m in report["models"].items() if m.get("zoo")}
    if not zoo:
        return []
    lines = [
        "",
        "Model zoo: where fusion helps, median (min). Launch overhead = fuse=False "
        "minus the floor per iteration; plain / floor = a standalone jitted step against "
        "the same step in the floor's loop. The verdict reads the minima.",
        "",
        "| model | data | floor us/step | fuse=False us | overhead us | overhead / step "
        "| plain / floor | fused / floor | fused / floor incl. transfer | resident / floor "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = (
        "floor_us",
        "unfused_us",
        "overhead_us",
        "overhead_over_step",
        "plain_over_floor",
        "fused_vs_floor",
        "fused_vs_floor_transfer",
        "resident_vs_floor",
    )
    for name, z in zoo.items():
        data = report["models"][name].get("data", "")
        cells = [_pair(z.get("median"), z.get("min"), key) for key in keys]
        lines.append(f"| {name} | {data} | " + " | ".join(cells) + f" | {z['verdict']} |")
    return lines


def _pair(median: dict[str, Any] | None, minimum: dict[str, Any] | None, key: str) -> str:
    digits = 1 if key.endswith("_us") else 2
    values = [None if part is None else part.get(key) for part in (median, minimum)]
    return f"{_ratio(values[0], digits)} ({_ratio(values[1], digits)})"


def _sweep_lines(report: dict[str, Any]) -> list[str]:
    sweep = report.get("sweep")
    if not sweep:
        return []
    lines = [
        "",
        f"Chunk-size sweep, {sweep['model']}: us/iteration (speedup over fuse=False "
        f"{_ratio(sweep['unfused_us'], 1)} us)",
        "",
        "| K | us/iter | speedup |",
        "|---|---|---|",
    ]
    for row in sweep["rows"]:
        lines.append(f"| {row['K']} | {_ratio(row['median_us'], 1)} | {_ratio(row['speedup'])}x |")
    return lines


def _compile_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("compile_vs_k")
    if not rows:
        return []
    lines = [
        "",
        f"Compile time of the fused chunk program against K "
        f"({report['compile_model']}; a loop, not unrolled, so it should not grow with K)",
        "",
        "| K | trace+lower s | compile s | XLA fusions | HLO chars |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['K']} | {row['trace_lower_s']:.3f} | {row['compile_s']:.3f} | "
            f"{row['fusions']} | {row['hlo_chars']} |"
        )
    return lines


def _overlap_lines(report: dict[str, Any]) -> list[str]:
    o = report.get("overlap")
    if not o:
        return []
    head = (
        f"Slow source ({o['model']}, fuse={o['fuse']}): each batch takes "
        f"{o['delay_us']:.0f} us to produce (sleep), as long as a fused step"
    )
    if o["status"] != "ok":
        return ["", f"{head}: {o['status']}: {o['reason']}"]
    return [
        "",
        f"{head}. Per epoch: data alone {o['data_s'] * 1e3:.1f} ms, compute alone "
        f"{o['compute_s'] * 1e3:.1f} ms, fused over the slow source "
        f"{o['fused_s'] * 1e3:.1f} ms = {o['fused_over_max']:.2f}x max(data, compute), "
        f"{o['fused_over_sum']:.2f}x their sum.",
    ]


def unwritable(path: str | None) -> str | None:
    """Why a result could not be written to `path` (its folder is made if missing), or
    None."""
    if path is None:
        return None
    target = Path(path)
    if path.endswith(("/", os.sep)):
        return "names a folder; give a file name in it"
    try:
        if target.is_dir():
            return "is a folder; give a file name"
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"its folder cannot be made ({error.strerror or error})"
    if not os.access(target.parent, os.W_OK):
        return "its folder is not writable"
    return None


def unplottable(path: str) -> str | None:
    """Why matplotlib cannot write a figure to `path`, or None.

    Its extension names no format matplotlib writes; None also where matplotlib is missing
    (the writer then says so itself).

    Example:
        >>> unplottable("figure.xyz") is not None, unplottable("figure.png")
        (True, None)
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    from ..handlers.plot import format_of

    try:
        format_of(Path(path), FigureCanvasBase.get_supported_filetypes())
    except ValueError as error:
        return str(error).split(": ", 1)[-1]
    return None


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2, default=str)
        handle.write("\n")


def _sweep_panel(left: Any, sweep: dict[str, Any] | None) -> None:
    """The plot's left panel: time per iteration against chunk size (mlp-small's sweep)."""
    if sweep:
        rows = [r for r in sweep["rows"] if r["median_us"] is not None]
        left.plot(
            [r["K"] for r in rows], [r["median_us"] for r in rows], "o-", label="fuseloop fuse=K"
        )
        for key, style, name in (
            ("unfused_us", "--", "fuse=False"),
            ("floor_transfer_us", ":", "floor incl. transfer"),
        ):
            if sweep.get(key):
                left.axhline(sweep[key], linestyle=style, color="gray", label=name)
        left.set_xscale("log", base=2)
        left.set_xlabel("chunk size K")
        left.set_ylabel("us / iteration (median)")
        left.set_title(f"{sweep['model']}: time per iteration vs chunk size")
        left.legend()
    else:  # the chunk-size sweep runs on mlp-small alone: say so rather than show an empty axes
        left.axis("off")
        left.text(
            0.5,
            0.5,
            "no chunk-size sweep:\nit runs when mlp-small is among --models",
            ha="center",
            va="center",
        )


def write_plot(report: dict[str, Any], path: str) -> str | None:
    """Writes the PNG; returns None, or why it could not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install 'fuseloop[plot]')"
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 7))
    _sweep_panel(left, report.get("sweep"))
    models = report["models"]
    keys = [
        k
        for k in models[next(iter(models))]["systems"]
        if not k.startswith("fl_fuse") or k in ("fl_fuse32", "fl_fuse32_resident", "fl_fuseauto")
    ]
    width = 0.8 / max(len(keys), 1)
    for j, key in enumerate(keys):
        values = [models[n]["systems"].get(key, {}).get("median_us") or 0.0 for n in models]
        label = models[next(iter(models))]["systems"][key]["label"]
        right.bar(
            [i + j * width for i in range(len(models))],
            values,
            width,
            label=label,
            color=plt.get_cmap("tab20")(j % 20),
        )
    right.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], list(models))
    right.set_yscale("log")
    right.set_ylabel("us / iteration (median, log scale)")
    right.set_title("per model and system (missing bar: skipped or refused)")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
