"""Device-resident datasets (`fl.data.arrays(..., device=True)`): no transfer per epoch.

The dataset is moved to the device once. Each epoch's order is computed on the device from
the source's seed and a device-side epoch counter, and every step gathers its batch by
index there, so an epoch moves nothing from the host: `stats["h2d_transfers"]` only counts
the dataset's one move. The batches are the ones the host path (`iter_epoch`) serves, in the
same order, so results match `device=False`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._events import CONTINUE
from ._programs import MIN_SLOTS

__all__ = ["ResidentData"]


class ResidentData:
    """Runs the epochs of a device-resident `ArraySource`, fused or unfused."""

    def __init__(self, source: Any, executor: Any, start_epoch: int):
        self.source, self.executor = source, executor
        placement = executor.placement
        # Over a mesh the dataset is replicated and each gathered chunk is sharded along
        # its batch axis, as a host-fed chunk would be.
        self.chunk_sharding = placement.chunk_sharding(source.batch_size)
        before = source.transfers_done
        self.data = source.put(placement.replicated)
        executor.stats["h2d_transfers"] += source.transfers_done - before
        # The epoch counter lives on the device, so advancing it moves nothing.
        self.epoch = jax.device_put(np.int32(start_epoch))
        cache = executor.loop._cache
        self.guard = executor.loop.guard_nonfinite
        key = ("resident_epoch", source.seed, source.n, source.batch_size, source.shuffle)
        if key not in cache:
            cache[key] = jax.jit(self._next_epoch_fn(source))
        self.next_epoch = cache[key]

    @staticmethod
    def _next_epoch_fn(source: Any) -> Any:
        def next_epoch(epoch: Any) -> tuple[Any, Any, Any]:
            indices = source.epoch_indices(source.seed, epoch)
            return indices, epoch + 1, jnp.zeros((), jnp.int32)

        return next_epoch

    def _limit(self, bound: int | None) -> int:
        return self.source.num_batches if bound is None else min(bound, self.source.num_batches)

    def unfused_feed(self, bound: int | None) -> tuple[Any, Any, int]:
        """`(next_batch, dispatch, bound)` for the executor's unfused loop: one gathered
        step per dispatch, still without any host transfer."""
        program = self.executor.compiled.resident(MIN_SLOTS, 1, self.chunk_sharding)
        limit = self._limit(bound)
        indices, self.epoch, cursor = self.next_epoch(self.epoch)
        position = {"cursor": cursor}

        def next_batch(i: int) -> Any:
            return True if i < limit else None

        def dispatch(_: Any, i: int) -> None:
            executor = self.executor
            executor.state, executor.tail, _, _, position["cursor"] = program(
                executor.state, executor.tail, self.data, indices, position["cursor"], limit)

        return next_batch, dispatch, limit

    def run_epoch(self, state: Any, bound: int | None, bus: Any, signals: Any
                  ) -> tuple[str, Any]:
        """One fused epoch, one dispatch per chunk, no host transfer."""
        executor = self.executor
        record = bus.has_iteration_handlers
        size = executor.fuse
        program = executor.compiled.resident(max(size, MIN_SLOTS), size, self.chunk_sharding)
        indices, self.epoch, cursor = self.next_epoch(self.epoch)
        limit = self._limit(bound)
        status, i, last = CONTINUE, 0, 0
        executor._previous = dict
        while i < limit:
            n = min(size, limit - i)
            executor.state, executor.tail, records, n_run, cursor = program(
                executor.state, executor.tail, self.data, indices, cursor, limit)
            executor.stats["dispatches"] += 1
            executor._metrics_cache = None
            status, state, last = executor._replay(state, bus, i, n, records, n_run, record,
                                                   self.guard, executor.tail)
            i += n
            if status != CONTINUE or signals.requested:
                break
        return status, state.replace(iteration=last)
