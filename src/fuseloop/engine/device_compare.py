"""The device's test of whether a monitored value beats the best so far by more than
`min_delta`, decided as the host's `Monitor.improves` decides (docs/design.md §9)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["beats_best"]


def beats_best(monitor: Any, value: Any, record: Any) -> Any:
    """`Monitor.improves` on the device. The host compares `value + min_delta` with `best`
    (mode "max": `value - min_delta`) in float64, as Keras 3 does; rounded to float32,
    0.9 + 0.1 is 1.0f, which then does not beat 1.0f. So a float32 threshold is kept
    unrounded, as a sum `s + t` (Knuth's two-sum; min_delta split in two float32s, best
    minus it), and `value - s`, exact near the threshold, is compared with `t`: the exact
    comparison, which the host's rounded one matches but within a few float64 ulps of the
    threshold (there the host's replay raises a FusionError, never a silent difference); a
    float64 one (64-bit mode) is rounded as the host's is."""
    best, sign = record["best"], (-1.0 if monitor.mode == "min" else 1.0)
    if monitor.min_delta == 0:
        beats = value < best if monitor.mode == "min" else value > best
    elif value.dtype == jnp.float64:
        moved = value - np.float64(sign * monitor.min_delta)
        beats = moved < best if monitor.mode == "min" else moved > best
    else:
        with np.errstate(over="ignore"):  # a min_delta past float32's range: no value beats
            high = np.float32(sign * monitor.min_delta)
            low = np.float32(sign * monitor.min_delta - float(high))
        s = best + high
        bent = s - best  # two-sum: s + e == best + high exactly
        e = (best - (s - bent)) + (high - bent)
        t = e + low
        beats = value - s < t if monitor.mode == "min" else value - s > t
    return jnp.isfinite(value) & (~record["has_best"] | beats)
