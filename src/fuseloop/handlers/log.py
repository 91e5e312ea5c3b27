"""Log lines: `Loop.log(fn, ...)` and the trainer's `log=N` lines.

Lines hold only the epoch, the iteration and metrics (no timings), so the output of a fused
and an unfused run is byte for byte the same. Text shown to people numbers epochs and
iterations from 1 (`Epoch 3/20`); the State stays 0-based. Every line is written through
`write_above_bars`, so a progress bar on the same terminal is cleared first and redrawn
below the line instead of being overwritten mid-line.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import numpy as np

from .._distributed import main_process_only
from .._loop_args import check_text_stream
from .._state import State

__all__ = [
    "Writer",
    "attach_trainer_log",
    "epoch_label",
    "format_metrics",
    "format_value",
    "write_above_bars",
]

SEPARATOR = " - "


def write_above_bars(text: str, stream: TextIO) -> None:
    r"""Writes `text` to `stream` above any tqdm bar drawn on the same terminal.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> write_above_bars("Epoch 1/2 - loss: 0.5000000\n", out)
        >>> out.getvalue()
        'Epoch 1/2 - loss: 0.5000000\n'
    """
    if _unwritable(stream):  # as print does: no stream (pythonw, a daemon), no output
        return
    if "tqdm" not in sys.modules:  # no bar can be on screen; do not import tqdm for nothing
        _write(text, stream)
        return
    from tqdm.std import tqdm

    # Clears every open bar that shares this stream (or the terminal, for stdout/stderr)
    # and redraws it after the write; a no-op when no bar is open.
    with tqdm.external_write_mode(file=stream):
        _write(text, stream)


def _unwritable(stream: TextIO | None) -> bool:
    """Whether `stream` is the process's missing or closed stdout/stderr.

    Output to it is dropped, as `print` drops it, rather than failing the run it reports
    on. A stream the user passed and closed still raises.
    """
    if stream is None:
        return True
    standard = stream is sys.stdout or stream is sys.stderr
    return standard and bool(getattr(stream, "closed", False))


def _write(text: str, stream: TextIO) -> None:
    stream.write(text)
    flush = getattr(stream, "flush", None)
    if flush is not None:
        flush()


class Writer:
    r"""Writes `fn(state)` to a stream (resolved at write time, so it follows sys.stdout).

    Example:
        >>> Writer(lambda s: f"epoch {s.epoch}\n")(fl.State(epoch=3))
        epoch 3
    """

    def __init__(self, fn: Callable[[State], str], stream: TextIO | None = None):
        if not callable(fn):
            raise ValueError(f"fn={fn!r} must be callable(state) -> str")
        check_text_stream(stream, "stream")
        self.fn, self.stream = fn, stream

    def __call__(self, state: State) -> None:
        """Writes `fn(state)` to the stream and flushes it."""
        text = self.fn(state)
        if not isinstance(text, str):
            raise ValueError(
                f"log: fn returned {type(text).__name__}; it must return a str "
                f"(add the newline yourself)"
            )
        write_above_bars(text, self.stream if self.stream is not None else sys.stdout)


def format_value(value: Any) -> str:
    """One metric value as text for a log line.

    7 decimals, scientific notation for tiny magnitudes and those of 1e8 or more (a
    diverging loss), arrays (a population's metrics) as
    `[a, b, ...]`.

    Example:
        >>> format_value(0.5), format_value(3e-9), format_value(2.5e23), format_value([1, 2])
        ('0.5000000', '3.0000000e-09', '2.5000000e+23', '[1.0000000, 2.0000000]')
    """
    if value is None:  # np.asarray would turn it into nan
        return "None"
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return " ".join(str(value).split())  # one line, whatever the object prints
    if array.ndim:
        return "[" + ", ".join(format_value(v) for v in array.ravel()) + "]"
    number = float(array)
    if number != 0 and math.isfinite(number) and not 1e-4 <= abs(number) < 1e8:
        return f"{number:.7e}"
    return f"{number:.7f}"


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """`name: value` pairs joined by " - ".

    Example:
        >>> format_metrics({"loss": 0.25, "accuracy": 1})
        'loss: 0.2500000 - accuracy: 1.0000000'
    """
    return SEPARATOR.join(f"{name}: {format_value(value)}" for name, value in metrics.items())


def epoch_label(epoch: int, max_epoch: int | None) -> str:
    """`Epoch e/E` numbered from 1 for people (`epoch` is the State's 0-based epoch).

    Example:
        >>> epoch_label(2, 20)
        'Epoch 3/20'
    """
    return f"Epoch {epoch + 1}/{max_epoch}" if max_epoch else f"Epoch {epoch + 1}"


def _line(*fields: str) -> str:
    return SEPARATOR.join(field for field in fields if field) + "\n"


def iteration_line(state: State) -> str:
    """The iteration line: `Epoch 1/3 - iteration 6 - loss: ... - accuracy: ...`.

    Epochs and iterations count from 1; the iteration shows `/N` under an `iterations`
    bound.
    """
    bound = f"/{state.max_iteration}" if state.max_iteration else ""
    return _line(
        epoch_label(state.epoch, state.max_epoch),
        f"iteration {state.iteration + 1}{bound}",
        format_metrics(state.metrics),
    )


class EpochSummary:
    """The trainer log's one line per epoch, with the epoch's final metrics.

    The trainer attaches its log before any `validate`, so at `epoch_completed` the
    validation metrics do not exist yet. The line is therefore written at the next
    boundary that sees the finished epoch in `state.history` (the next `epoch_started`,
    or the end of the run), when every handler of that epoch has run.
    """

    # One run at a time: it keeps its run's next epoch to print (engine/serving.py).
    fuseloop_serves_one_run = True

    def __init__(self, stream: TextIO | None):
        self.stream = stream
        self.pending: int | None = None

    def started(self, state: State) -> None:
        self.pending = None  # a Loop is reusable: forget a previous run that raised

    def ended(self, state: State) -> None:
        self.pending = state.epoch

    def flush(self, state: State) -> None:
        epoch, self.pending = self.pending, None
        if epoch is None or epoch not in state.history:
            return
        text = _line(epoch_label(epoch, state.max_epoch), format_metrics(state.history[epoch]))
        write_above_bars(text, self.stream if self.stream is not None else sys.stdout)


def attach_trainer_log(loop: Any, every: int, stream: TextIO | None) -> Any:
    """The `trainer(log=N)` lines: one every N iterations and one per finished epoch.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> state = attach_trainer_log(loop, 2, out).run(batches, epochs=1)
        >>> [line.split(" - ")[:2] for line in out.getvalue().splitlines()]
        [['Epoch 1/1', 'iteration 1'], ['Epoch 1/1', 'iteration 3'], ['Epoch 1/1', 'loss: ...']]
    """
    summary = EpochSummary(stream)
    loop = _observe(loop, "iteration_completed", Writer(iteration_line, stream), {"every": every})
    for event, action in (
        ("started", summary.started),
        ("epoch_started", summary.flush),
        ("epoch_completed", summary.ended),
        ("epoch_halted", summary.ended),
        ("completed", summary.flush),
        ("halted", summary.flush),
    ):
        loop = _observe(loop, event, action)
    return loop


def _observe(loop: Any, event: str, fn: Callable[[State], None], filter: Any = "always") -> Any:
    """Attaches a handler that only observes the State.

    `Loop.observe` (where the loop has it) never splits a multi-epoch dispatch, which a
    plain handler may.
    """
    fn = main_process_only(fn)  # log lines are written once, by process 0
    observe = getattr(loop, "observe", None)
    if observe is not None:
        return observe(event, fn, filter, name="log")
    return loop.handle_event(event, fn, filter, name="log")
