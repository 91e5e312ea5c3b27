"""Writing a line to a stream that a progress bar may be drawn on (one job, shared by the
log lines and the progress display, which is why it sits below both)."""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["write_above_bars"]


def write_above_bars(text: str, stream: TextIO) -> None:
    """Writes `text` to `stream` above any tqdm bar drawn on the same terminal.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> write_above_bars("Epoch 1/2 - loss: 0.5000000\\n", out)
        >>> out.getvalue()
        'Epoch 1/2 - loss: 0.5000000\\n'
    """
    if "tqdm" not in sys.modules:  # no bar can be on screen; do not import tqdm for nothing
        _write(text, stream)
        return
    from tqdm.std import tqdm

    # Clears every open bar that shares this stream (or the terminal, for stdout/stderr)
    # and redraws it after the write; a no-op when no bar is open.
    with tqdm.external_write_mode(file=stream):
        _write(text, stream)


def _write(text: str, stream: TextIO) -> None:
    stream.write(text)
    flush = getattr(stream, "flush", None)
    if flush is not None:
        flush()
