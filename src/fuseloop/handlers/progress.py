"""`run(progress=True)`: a tqdm bar per epoch, updated at host boundaries only.

The bar never reads a device value itself: it shows metrics when the loop already read them
(a handler fired, a chunk was replayed, or the epoch ended).
"""

from __future__ import annotations

from typing import Any

from .._events import Event

__all__ = ["ProgressBar"]


class ProgressBar:
    """One tqdm bar per epoch."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_event(self, event: Event, state: Any) -> None:
        if event == Event.EPOCH_STARTED:
            from tqdm.auto import tqdm

            self.close()
            self.bar = tqdm(total=state.max_iteration, desc=f"Epoch {state.epoch}",
                            leave=True, dynamic_ncols=True)
        elif event in (Event.EPOCH_COMPLETED, Event.EPOCH_HALTED) and self.bar is not None:
            self._show(state.metrics)
            self.close()

    def advance(self, n: int, metrics: dict[str, Any] | None) -> None:
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
        if self.bar is not None:
            self.bar.close()
            self.bar = None
