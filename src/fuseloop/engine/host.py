"""The one place device values are read on the host (docs/design.md §2)."""

from __future__ import annotations

from typing import Any

import jax

from .._metrics import read_metric
from .population import member_metrics

__all__ = ["HostReads"]


class HostReads:
    """Pulls device values to the host and counts each pull in `stats["host_syncs"]`.

    Every caller names its read in a comment ("Host read: ..."), so the places a run waits
    for the device can be found by searching for that phrase.
    """

    def __init__(self, stats: dict[str, Any], metrics: tuple[Any, ...], members: int = 0):
        self.stats, self.metrics = stats, metrics
        self.members = members  # a population's size (0: a solo run)

    def get(self, tree: Any) -> Any:
        self.stats["host_syncs"] += 1
        return jax.device_get(tree)

    def metrics_of(self, acc_host: dict[str, Any]) -> dict[str, Any]:
        """Host floats from accumulators already on the host (no read here); a
        population's are float64 arrays of shape (N,).
        """
        if self.members:
            return member_metrics(self.metrics, acc_host, self.members)
        return {
            m.name: read_metric(m, acc_host[m.name])
            for m in self.metrics
            if float(acc_host[m.name]["count"]) > 0
        }

    def record_metrics(self, records: Any, j: int) -> dict[str, Any]:
        """The metrics of slot `j` of a chunk's records already on the host."""
        acc = {
            name: {key: column[j] for key, column in rec.items()} for name, rec in records.items()
        }
        return self.metrics_of(acc)
