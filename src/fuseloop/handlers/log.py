"""Log lines: `Loop.log(fn, ...)` and the trainer's `log=N` line.

Lines hold only the epoch, the iteration and metrics (no timings), so the output of a fused
and an unfused run is byte for byte the same.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

from .._state import State

__all__ = ["Writer", "attach_trainer_log", "format_metrics"]


class Writer:
    """Writes `fn(state)` to a stream (resolved at write time, so it follows sys.stdout)."""

    def __init__(self, fn: Callable[[State], str], stream: TextIO | None = None):
        if not callable(fn):
            raise ValueError(f"fn={fn!r} must be callable(state) -> str")
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise ValueError(f"stream={stream!r} must be a writable text stream (with .write) "
                             f"or None for stdout")
        self.fn, self.stream = fn, stream

    def __call__(self, state: State) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        text = self.fn(state)
        if not isinstance(text, str):
            raise ValueError(f"log: fn returned {type(text).__name__}; it must return a str "
                             f"(add the newline yourself)")
        stream.write(text)
        flush = getattr(stream, "flush", None)
        if flush is not None:
            flush()


def format_metrics(metrics: dict[str, Any]) -> str:
    """`name: 0.1234567` pairs with fixed 7-digit formatting."""
    parts = []
    for name, value in metrics.items():
        try:
            parts.append(f"{name}: {float(value):.7f}")
        except (TypeError, ValueError):
            parts.append(f"{name}: {value}")
    return " ".join(parts)


def _iteration_line(state: State) -> str:
    return f"\rEpoch: {state.epoch}, Iteration: {state.iteration}, {format_metrics(state.metrics)}"


def attach_trainer_log(loop: Any, every: int, stream: TextIO | None) -> Any:
    """The `trainer(log=N)` line every N iterations, and a newline at each epoch end."""
    loop = loop.handle_event("iteration_completed", Writer(_iteration_line, stream),
                             {"every": every}, name="log")
    return loop.handle_event("epoch_completed", Writer(lambda s: "\n", stream), name="log")
