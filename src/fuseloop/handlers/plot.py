"""`fl.plot_history`: a PNG of the metric curves, training and validation on shared axes.

matplotlib is an optional extra (`pip install fuseloop[plot]`); it is imported only here,
and only its object-oriented API is used (no pyplot), so plotting changes no global
matplotlib state such as the backend.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._arg_types import user_path
from .._distributed import is_main_process
from .._metrics import VALIDATION_PREFIX
from .._state import State
from .writers import scalar_metrics

__all__ = ["format_of", "plot_history"]


def _series(
    history: Mapping[int, Mapping[str, Any]],
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{base metric: {"training"|"validation": [(epoch, value), ...]}}, epochs ascending.

    Epochs are numbered from 1 as people count them (`state.history` keys are 0-based).
    """
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for epoch in sorted(history, key=int):
        for name, value in scalar_metrics(dict(history[epoch])).items():
            split = "validation" if name.startswith(VALIDATION_PREFIX) else "training"
            base = name.removeprefix(VALIDATION_PREFIX)
            panels.setdefault(base, {}).setdefault(split, []).append((int(epoch) + 1, value))
    return panels


def _figure_class() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plot_history needs matplotlib: pip install fuseloop[plot]") from None
    return Figure, FigureCanvasAgg


def plot_history(
    history: Mapping[int, Mapping[str, Any]] | State,
    path: str | os.PathLike[str],
    metrics: list[str] | str | None = None,
    title: str | None = None,
) -> Path:
    """Writes a figure of one panel per metric: training and `validation_<name>` together.

    Args:
        history: `state.history` (epoch -> metrics), or a State; the x axis numbers
            epochs from 1.
        path: The file to write: a PNG, or another format matplotlib writes named by the
            extension (".pdf", ".svg", ...).
        metrics: The metric names to plot, or one name (default: every scalar metric in
            the history). A name's panel shows its training and validation values;
            `"validation_<name>"` plots the validation values alone; a population's
            metric gets a panel per member (`"loss"` plots `loss[0]`, `loss[1]`, ...).
        title: A title over the figure.

    Returns:
        The path written. Under jax.distributed only process 0 writes it (every process
        holds the same history); the others return the path without writing.

    Example:
        >>> import os, tempfile
        >>> state = loop.run(batches, epochs=3)
        >>> path = fl.plot_history(state.history, os.path.join(tempfile.mkdtemp(), "h.png"))
        >>> os.path.getsize(path) > 0
        True
    """
    if isinstance(metrics, str):
        metrics = [metrics]
    path = user_path(path)
    panels = _panels(history.history if isinstance(history, State) else history, metrics)
    if path.is_dir():
        raise ValueError(f"path={str(path)!r} is a folder; give a file name, e.g. history.png")
    if not is_main_process():  # side effects happen once, on process 0
        return path
    figure = _figure(panels)
    if title:
        figure.suptitle(title)
    file_format = format_of(path, figure.canvas.get_supported_filetypes())
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format=file_format, dpi=100)
    return path


def format_of(path: Path, supported: Mapping[str, str]) -> str:
    """The image format `path`'s extension names (none: PNG).

    A ValueError where matplotlib writes no such format, rather than PNG bytes under
    another name.
    """
    suffix = path.suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in supported:
        raise ValueError(
            f"path={str(path)!r}: matplotlib writes no .{suffix} files; name the file with "
            f"one of {', '.join('.' + name for name in sorted(supported))}"
        )
    return suffix


def _panels(
    history: Any, metrics: list[str] | None
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The series to plot, one panel per metric; a ValueError says what is wrong."""
    if not isinstance(history, Mapping) or not history:
        raise ValueError(
            "history must be a non-empty mapping epoch -> metrics "
            "(state.history after at least one epoch), or a State"
        )
    panels = _series(history)
    if metrics is not None and not metrics:
        raise ValueError(
            f"metrics={metrics!r} names no metric to plot; pass at least one name, or "
            f"None (the default) for every scalar metric: {', '.join(sorted(panels))}"
        )
    if metrics is not None:
        # A metric's panel shows both splits; `validation_<name>` asks for that split alone.
        one_split = {
            VALIDATION_PREFIX + base: {"validation": splits["validation"]}
            for base, splits in panels.items()
            if "validation" in splits
        }
        choices = {**panels, **one_split}
        # A population's metric is plotted per member: "loss" asks for loss[0], loss[1], ...
        metrics = [
            each for m in metrics for each in ([m] if m in choices else _members(m, choices) or [m])
        ]
        unknown = [m for m in metrics if m not in choices]
        if unknown:
            raise ValueError(
                f"metrics={unknown!r} are not in the history; accepted values: "
                f"{', '.join(sorted(choices))}"
            )
        panels = {m: choices[m] for m in metrics}
    if not panels:
        raise ValueError("history holds no scalar metric to plot")
    return panels


def _members(name: str, choices: Mapping[str, Any]) -> list[str]:
    """A population metric's per-member panels, `name[0]`, `name[1]`, ... (none: [])."""
    member = re.compile(re.escape(name) + r"\[([0-9]+)\]")
    found = [(int(m[1]), c) for c in choices if (m := member.fullmatch(c))]
    return [c for _, c in sorted(found)]


def _figure(panels: dict[str, dict[str, list[tuple[int, float]]]]) -> Any:
    """A matplotlib Figure (on an Agg canvas) with a grid of up to 3 panels a row."""
    figure_cls, canvas_cls = _figure_class()
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = figure_cls(figsize=(4.2 * columns, 3.2 * rows), layout="constrained")
    canvas_cls(figure)
    for index, (name, splits) in enumerate(panels.items()):
        axes = figure.add_subplot(rows, columns, index + 1)
        for split, style in (("training", "o-"), ("validation", "s--")):
            if split in splits:
                epochs, values = zip(*splits[split], strict=True)
                axes.plot(epochs, values, style, markersize=3, label=split)
        axes.set_title(name)
        axes.set_xlabel("epoch")
        axes.grid(True, alpha=0.3)
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.legend(fontsize="small")
    return figure
