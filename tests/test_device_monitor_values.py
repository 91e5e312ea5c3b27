"""A monitored metric read on the device is the value the host reads from the same sums.

The device monitors (early stopping, plateaus, checkpoint-on-best inside a multi-epoch
dispatch) decide on a value computed on the device, and the host checks that it decides
the same; a value one ulp off turns a tie into an improvement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fuseloop._metrics import read_metric
from fuseloop.engine.device_monitors import device_value


class _Mean:
    accumulate = "mean"


def test_a_mean_over_a_count_known_when_compiled_is_the_hosts_value():
    # A validation set's count is a constant of the program: XLA would multiply by its
    # reciprocal (39/44 came out 0.8863636851 against the host's 0.8863636255).
    mismatched = []
    for count in range(1, 60):
        known = jnp.float32(count)
        read = jax.jit(lambda total, c=known: device_value(_Mean, {"sum": total, "count": c}))
        for total in range(count + 1):
            host = read_metric(_Mean, {"sum": np.float32(total), "count": np.float32(count)})
            if float(read(jnp.float32(total))) != host:
                mismatched.append((total, count))
    assert mismatched == []


def test_a_populations_means_over_one_shared_count_are_the_hosts_values():
    totals = np.arange(45, dtype=np.float32)
    read = jax.jit(lambda t: device_value(_Mean, {"sum": t, "count": jnp.float32(44)}))
    np.testing.assert_array_equal(np.asarray(read(totals)), totals / np.float32(44))
