"""The one place device values are read on the host (docs/design.md §2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

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
        # On a CPU a device buffer is host memory, and a leaf reads as a view of it;
        # `jax.device_get` first schedules a copy of every leaf, which costs the host about
        # 10 us a leaf (measured: 42 us against 5 us for a chunk's 3-leaf records,
        # docs/design.md §6). Elsewhere device_get's copies run in parallel.
        self.views = jax.default_backend() == "cpu"
        self._before_waiting: list[Callable[[], None]] = []

    def before_waiting(self, work: list[Callable[[], None]]) -> None:
        """Work for the host to do before its next read, which waits for the device: done
        then, it is off the run's critical path (spares, docs/design.md §6)."""
        self._before_waiting.extend(work)

    def get(self, tree: Any) -> Any:
        """`tree` with its device arrays read to the host (numpy arrays, read-only)."""
        if self._before_waiting:
            work, self._before_waiting = self._before_waiting, []
            for item in work:
                item()
        self.stats["host_syncs"] += 1
        if not self.views:
            return jax.device_get(tree)
        with jax.transfer_guard_device_to_host("allow"):  # an explicit read, as device_get's
            return jax.tree.map(_host_value, tree)

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


def _host_value(leaf: Any) -> Any:
    """What `jax.device_get` makes of one leaf, read as a view where it is on the host."""
    if isinstance(leaf, jax.Array) and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
        return np.asarray(leaf)
    if isinstance(leaf, jax.Array):  # typed PRNG keys have no numpy form of their own
        return jax.device_get(leaf)
    to_array = getattr(leaf, "__array__", None)
    return leaf if to_array is None else to_array()
