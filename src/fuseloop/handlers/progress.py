"""`run(progress=True)`: a bar per epoch on a terminal, one plain line per epoch elsewhere.

The display never reads a device value itself: it shows metrics when the loop already read
them (a handler fired, a chunk was replayed, or the epoch ended). On a terminal (or in a
notebook) it is a tqdm bar; when stderr is not a terminal (CI, a redirected file) carriage
returns would only pile up, so it writes one line at each epoch's end instead, as Keras's
`verbose=2` does. Log lines go through `write_above_bars`, which clears the bar, writes the
line and redraws the bar below it, so a line is never mixed into the bar.
"""

from __future__ import annotations

import collections.abc
import contextlib
import sys
import time
from typing import Any, TextIO

import numpy as np

from .._distributed import is_main_process
from .._events import Event
from .log import _unwritable, write_above_bars  # the display and the log share them

__all__ = ["ProgressBar", "epoch_length_of", "run_progress_bar", "write_above_bars"]


def epoch_length_of(data: Any, iterations: int | None = None) -> int | None:
    """Iterations per epoch when the data source knows its length, else None.

    The length is `len(data)`, capped by `iterations`; one-shot iterators and callables
    have none.

    Example:
        >>> epoch_length_of([(0, 0)] * 5), epoch_length_of([(0, 0)] * 5, iterations=3)
        (5, 3)
        >>> epoch_length_of(iter([(0, 0)])) is None
        True
    """
    length = None
    if isinstance(data, collections.abc.Sized) and not isinstance(data, collections.abc.Iterator):
        # A tf.data dataset of unknown length, a torch IterableDataset's loader: TypeError.
        with contextlib.suppress(TypeError):
            length = len(data)
    if iterations is not None and length is not None:
        return min(length, iterations)
    return length  # unknown: the display caps it by `iterations` and learns it (`_open`)


def _interactive(stream: TextIO) -> bool:
    """A terminal, or a notebook (where tqdm draws a widget), rather than a file or a pipe."""
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        pass
    from tqdm.auto import tqdm

    return any(base.__module__ == "tqdm.notebook" for base in tqdm.__mro__)


class ProgressBar:
    """The epoch display of `run(progress=True)`.

    The loop drives it with `on_event`, `advance` and `close`.

    Args:
        epoch_length: Iterations per epoch when the data source knows it (see
            `epoch_length_of`); otherwise the bar learns it from the first epoch.
        stream: Where to draw (default: `sys.stderr` when the first epoch starts).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> bar = ProgressBar(epoch_length=4, stream=out)
        >>> state = loop.run(batches)
        >>> bar.on_event(Event.EPOCH_STARTED, state)
        >>> bar.advance(4, dict(state.metrics))
        >>> bar.on_event(Event.EPOCH_COMPLETED, state)
        >>> bar.close()
        >>> "4/4" in out.getvalue()
        True
    """

    def __init__(self, epoch_length: int | None = None, stream: TextIO | None = None) -> None:
        self.epoch_length, self.stream = epoch_length, stream
        self.bar: Any = None
        self.last_length: int | None = None
        self.plain: dict[str, Any] | None = None  # the epoch a plain line will report

    @classmethod
    def for_data(
        cls, data: Any, iterations: int | None = None, stream: TextIO | None = None
    ) -> ProgressBar:
        """A display whose bar knows the epoch's length when `data` knows it."""
        return cls(epoch_length_of(data, iterations), stream)

    def on_event(self, event: Event, state: Any) -> None:
        """Opens a bar when an epoch starts and closes it when the epoch ends."""
        if event == Event.EPOCH_STARTED:
            self.close()
            self._open(state)
        elif event in (Event.EPOCH_COMPLETED, Event.EPOCH_HALTED):
            # An epoch of unknown length is learnt from the last complete one: a halted
            # epoch stopped short of it.
            complete = event == Event.EPOCH_COMPLETED
            if self.bar is not None:
                self.last_length = self.bar.n if complete else self.last_length
                self._show(state.metrics)
                self.close()
            elif self.plain is not None:
                self.last_length = self.plain["done"] if complete else self.last_length
                # An epoch halted midway is marked as the docs say: "stopped".
                stopped = "stopped" if event == Event.EPOCH_HALTED else ""
                self._write_plain(state.metrics, stopped)

    def _open(self, state: Any) -> None:
        from .log import epoch_label

        stream = self.stream if self.stream is not None else sys.stderr
        if _unwritable(stream):  # no stderr to draw on (pythonw, a daemon): no display
            return
        known = self.epoch_length or self.last_length  # a source's length, or the last epoch's
        total = state.max_iteration or known
        if state.max_iteration and known:
            total = min(state.max_iteration, known)
        label = epoch_label(state.epoch, state.max_epoch)
        if _interactive(stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=label, leave=True, dynamic_ncols=True, file=stream)
        else:
            self.plain = {
                "label": label,
                "total": total,
                "done": 0,
                "stream": stream,
                "began": time.perf_counter(),
                "metrics": {},
            }

    def advance(self, n: int, metrics: dict[str, Any] | None) -> None:
        """Moves the display by `n` iterations; shows `metrics` if the loop already read them."""
        if self.bar is not None:
            self.bar.update(n)
            if metrics:
                self._show(metrics)
        elif self.plain is not None:
            self.plain["done"] += n
            if metrics:
                self.plain["metrics"] = dict(metrics)

    def _show(self, metrics: dict[str, Any]) -> None:
        shown = {}
        for name, value in metrics.items():
            if value is None:  # not a number (np.asarray would make it nan)
                continue
            try:  # a population's metrics are arrays, one value per member
                array = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError):
                continue
            values = ", ".join(f"{v:.4f}" for v in array.ravel())
            shown[name] = f"[{values}]" if array.ndim else values
        self.bar.set_postfix(shown, refresh=False)

    def _write_plain(self, metrics: dict[str, Any], note: str) -> None:
        from .log import SEPARATOR, format_metrics

        plain, self.plain = self.plain, None
        if plain is None:  # no epoch is being counted
            return
        done, total = plain["done"], plain["total"]
        fields = [
            plain["label"],
            f"{done}/{total}" if total else f"{done} iterations",
            f"{time.perf_counter() - plain['began']:.1f}s",
            note,
            format_metrics(metrics),
        ]
        write_above_bars(SEPARATOR.join(f for f in fields if f) + "\n", plain["stream"])

    def close(self) -> None:
        """Closes the current bar; it stays on screen.

        An epoch that never ended (a halt mid-epoch, an error) still gets its plain line,
        marked "stopped".
        """
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.plain is not None:
            self._write_plain(self.plain["metrics"], "stopped")


def run_progress_bar(data: Any, iterations: int | None) -> ProgressBar | None:
    """The observer that draws `run(progress=True)`'s bar, or None off process 0.

    The bar is drawn on process 0 only, so its side effect happens once.

    Example:
        >>> run_progress_bar(batches, iterations=3).epoch_length
        3
    """
    return ProgressBar.for_data(data, iterations) if is_main_process() else None
