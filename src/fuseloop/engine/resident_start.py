"""A resident run's start: its dataset placed on the device once, and the first batch of
its starting epoch gathered there and read back for the initialization and the checks
(docs/design.md §1, the resident feed)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._epoch_order import prng_config
from .programs import keep_recent, kept_order

__all__ = ["place_dataset", "first_resident_batch"]


def place_dataset(source: Any, placement: Any, stats: dict[str, Any]) -> Any:
    """A resident source's arrays on the device (over a mesh, each device holds its block of
    the examples: `Placement.dataset`); the one move is counted as a transfer, and later
    runs of the same source reuse it.
    """
    before = source.transfers_done
    data = source.put(placement.dataset)
    stats["h2d_transfers"] += source.transfers_done - before
    return data


def first_resident_batch(
    programs: Any, source: Any, data: Any, epoch: Any, reads: Any, start_epoch: int
) -> Any:
    """The first batch of `epoch` (a device int32 scalar; `start_epoch` on the host),
    gathered on the device (the same rows the host source serves first) and read back: it
    shapes the initialization and the checks.

    Its values are a function of the source alone (its arrays, seed and order), so the
    host copy is kept beside the source, as the device copy is (a few epochs' worth: on
    CPU the copy holds the device buffers it was read from): a later run of the same
    source from the same epoch reads nothing.
    """
    key = (start_epoch, prng_config(), bool(jax.config.read("jax_enable_x64")))
    kept = source.first_batches.get(key)
    if kept is not None:
        return kept
    sharding = jax.tree.leaves(data)[0].sharding
    replicated = None
    if isinstance(sharding, NamedSharding):  # over a mesh: read it whole on every process
        replicated = NamedSharding(sharding.mesh, PartitionSpec())
    # Host read: the first batch, once per source and epoch.
    order = kept_order(source, start_epoch, lambda: programs.epoch_order(source)(epoch)[0])
    batch = reads.get(programs.first_batch(source, replicated)(data, order))
    for leaf in jax.tree.leaves(batch):
        if isinstance(leaf, np.ndarray):
            leaf.flags.writeable = False  # shared by later runs: nobody may edit it
    keep_recent(source.first_batches, key, batch)
    return batch
