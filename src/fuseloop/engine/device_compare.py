"""The device's test of whether a monitored value beats the best so far by more than
`min_delta`, decided as the host's `Monitor.improves` decides (docs/design.md §9)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["beats_best"]


def beats_best(monitor: Any, value: Any, record: Any) -> Any:
    """`Monitor.improves` on the device. The host compares `value` with `best - min_delta`
    (mode "max": `+`; early_stop: `value + min_delta` with `best`) in float64; rounded to
    float32, 1.0 - 0.1 is 0.9f, which 0.9f does not beat. So a float32 difference is kept
    unrounded, as a sum `s + t` (Knuth's two-sum; min_delta split in two float32s), and
    `value - s`, exact near the threshold, is compared with `t`; a float64 one (64-bit
    mode) is rounded as the host's is."""
    best, sign = record["best"], (-1.0 if monitor.mode == "min" else 1.0)
    if monitor.min_delta == 0:
        beats = value < best if monitor.mode == "min" else value > best
    elif value.dtype == jnp.float64:
        delta = np.float64(sign * monitor.min_delta)
        moved, bar = (value - delta, best) if monitor.on_value else (value, best + delta)
        beats = moved < bar if monitor.mode == "min" else moved > bar
    else:
        high = np.float32(sign * monitor.min_delta)
        low = np.float32(sign * monitor.min_delta - float(high))
        s = best + high
        bent = s - best  # two-sum: s + e == best + high exactly
        e = (best - (s - bent)) + (high - bent)
        t = e + low
        beats = value - s < t if monitor.mode == "min" else value - s > t
    return jnp.isfinite(value) & (~record["has_best"] | beats)
