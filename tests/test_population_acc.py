"""A population's packed accumulators (engine/population_acc.py): a pytree that reads as
the unpacked accumulators, and values moved, never changed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fuseloop._metrics import MetricSpec
from fuseloop.engine.host import HostReads
from fuseloop.engine.population import population_tail
from fuseloop.engine.population_acc import PackedAcc, pack, packed_like


def _acc():
    return {
        "loss": {"count": jnp.float32(3.0), "sum": jnp.float32(1.5)},
        "grid": {"cells": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)},
        "steps": {"n": jnp.int32(7)},
    }


def test_pack_round_trips_every_leaf_bitwise():
    acc = _acc()
    packed = pack(acc)
    assert [b.dtype for b in packed.buffers] == [jnp.float32, jnp.int32]
    assert packed.buffers[0].shape == (8,)
    back = packed.unpack()
    assert jax.tree.structure(back) == jax.tree.structure(acc)
    for a, b in zip(jax.tree.leaves(acc), jax.tree.leaves(back), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert sorted(packed) == ["grid", "loss", "steps"] and len(packed) == 3
    assert float(packed["loss"]["sum"]) == 1.5


def test_leading_axes_and_pytree_maps():
    packed = pack(_acc())
    stacked = jax.tree.map(lambda a: jnp.stack([a, a * 2, a * 3]), packed)
    assert isinstance(stacked, PackedAcc) and stacked.buffers[0].shape == (3, 8)
    np.testing.assert_array_equal(stacked["loss"]["sum"], [1.5, 3.0, 4.5])
    assert stacked["grid"]["cells"].shape == (3, 2, 3)
    host = jax.device_get(stacked)
    assert isinstance(host, PackedAcc) and isinstance(host.buffers[0], np.ndarray)
    added = jax.jit(lambda p: jax.tree.map(lambda a: a + 1, p))(packed)
    assert float(added["loss"]["count"]) == 4.0
    assert packed_like(_acc(), 0) is not None  # a plain accumulator stays plain


def test_population_tail_reads_through_host_reads():
    specs = (MetricSpec("loss", None, source="loss"), MetricSpec("lr", None, source="lr"))
    tail = population_tail(specs, False, 4)
    # 4 members by 2 metrics' sums, counts and their compensations (`_sums.accumulate`)
    assert isinstance(tail["acc"], PackedAcc) and tail["acc"].buffers[0].shape == (4, 8)
    filled = jax.tree.map(lambda a: a + jnp.arange(1, 5, dtype=a.dtype)[:, None], tail["acc"])
    reads = HostReads({"host_syncs": 0}, specs, members=4)
    metrics = reads.metrics_of(jax.device_get(filled))
    np.testing.assert_array_equal(metrics["loss"], [1.0, 1.0, 1.0, 1.0])
    records = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), filled)
    slot = reads.record_metrics(jax.device_get(records), 1)
    np.testing.assert_array_equal(slot["lr"], [1.0, 1.0, 1.0, 1.0])
