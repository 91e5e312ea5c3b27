"""Input checks with clear errors (placeholder: the reliability work fills this in)."""

from __future__ import annotations

from typing import Any

__all__ = ["Checker"]


class Checker:
    """Checks batches as they arrive; cheap enough to run on every batch."""

    def __init__(self, program: Any):
        self.program = program

    def first(self, batch: Any) -> None:
        """Called once with the run's first batch, before anything compiles."""

    def batch(self, batch: Any, epoch: int, iteration: int) -> None:
        """Called for each unfused batch before it is moved to the device."""

    def chunk(self, batches: list[Any], epoch: int, first_iteration: int) -> None:
        """Called for each fused chunk's batches before they are stacked."""
