"""`run(progress=True)`: a tqdm bar per epoch, updated at host boundaries only.

The bar never reads a device value itself: it shows metrics when the loop already read them
(a handler fired, a chunk was replayed, or the epoch ended).
"""

from __future__ import annotations

from typing import Any

from .._events import Event

__all__ = ["ProgressBar"]


class ProgressBar:
    """One tqdm bar per epoch, on stderr.

    Example:
        >>> state = loop.run(data, epochs=3, progress=True)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.bar: Any = None
        self.last_length: int | None = None

    def on_event(self, event: Event, state: Any) -> None:
        if event == Event.EPOCH_STARTED:
            from tqdm.auto import tqdm

            self.close()
            # Without an `iterations` bound the epoch's length is unknown until it ends;
            # the previous epoch's length is the best guess for a re-iterable source.
            total = state.max_iteration or self.last_length
            self.bar = tqdm(total=total, desc=f"Epoch {state.epoch}",
                            leave=True, dynamic_ncols=True)
        elif event in (Event.EPOCH_COMPLETED, Event.EPOCH_HALTED) and self.bar is not None:
            if event == Event.EPOCH_COMPLETED:
                self.last_length = self.bar.n
            self._show(state.metrics)
            self.close()

    def advance(self, n: int, metrics: dict[str, Any] | None) -> None:
        """Moves the bar by `n` iterations; shows `metrics` if the loop already read them."""
        if self.bar is None:
            return
        self.bar.update(n)
        if metrics:
            self._show(metrics)

    def _show(self, metrics: dict[str, Any]) -> None:
        shown = {}
        for name, value in metrics.items():
            try:
                shown[name] = f"{float(value):.4f}"
            except (TypeError, ValueError):
                continue
        self.bar.set_postfix(shown, refresh=False)

    def close(self) -> None:
        """Closes the current bar (it stays on screen)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
