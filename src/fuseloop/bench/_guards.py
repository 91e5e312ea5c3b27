"""Honesty guards: a timing is only reported when the work it timed is verified.

A system's sample is refused (with the reason) unless its inputs and outputs sit on the
intended device, nothing it produced is NaN or infinite, and - across systems - the fused
and unfused fuseloop runs end with bitwise-identical parameters and the reference loops
(floor, plain, host callback) compute the same training as fuseloop.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = [
    "Refused",
    "Skipped",
    "devices_of",
    "check_devices",
    "check_finite",
    "check_bitwise",
    "check_close",
    "max_abs_diff",
]


class Refused(Exception):
    """A timing that failed a guard; the message says which and why."""


class Skipped(Exception):
    """A peer that cannot run here (not installed, no matching device)."""


def devices_of(tree: Any) -> set[str]:
    """The devices holding the jax arrays of `tree`, as strings (`"TFRT_CPU_0"`, ...)."""
    found: set[str] = set()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            found.update(str(d) for d in leaf.devices())
    return found


def check_devices(found: set[str], intended: str, what: str) -> None:
    """Refuses unless `found` is exactly `{intended}`."""
    if not found:
        raise Refused(f"{what}: no device array found to verify")
    if found != {intended}:
        raise Refused(f"{what} on {sorted(found)}, not on the intended device {intended}")


def check_finite(tree: Any, what: str) -> None:
    """Refuses if any leaf holds a NaN or an infinity."""
    for leaf in jax.tree.leaves(tree):
        array = np.asarray(leaf)
        if array.dtype.kind in "fc" and not np.all(np.isfinite(array)):
            raise Refused(f"{what} holds NaN or infinite values")


def _pairs(a: Any, b: Any, what: str) -> list[tuple[np.ndarray, np.ndarray]]:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    expected: object = tree_a  # this jaxlib has no stub for PyTreeDef: compare as objects
    if expected != tree_b:
        raise Refused(f"{what}: different parameter structures")
    pairs = [(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b, strict=True)]
    for x, y in pairs:
        if x.shape != y.shape or x.dtype != y.dtype:
            raise Refused(f"{what}: leaf {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}")
    return pairs


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest elementwise difference between two pytrees of the same structure."""
    pairs = _pairs(a, b, "compare")
    return max((float(np.max(np.abs(x - y))) for x, y in pairs if x.size), default=0.0)


def check_bitwise(a: Any, b: Any, what: str) -> None:
    """Refuses unless every leaf of `a` and `b` is bit-for-bit identical."""
    for x, y in _pairs(a, b, what):
        if x.tobytes() != y.tobytes():
            diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
            raise Refused(
                f"{what}: parameters differ (max abs diff {diff:.3g}), expected bitwise equality"
            )


def check_close(a: Any, b: Any, what: str, atol: float = 1e-4) -> float:
    """Refuses unless `a` and `b` agree within `atol`; returns the max abs difference.

    Used for loops that run the same step as fuseloop but are compiled differently (a scan,
    a per-batch jit), where XLA may round differently but must not compute less.
    """
    _pairs(a, b, what)
    diff = max_abs_diff(a, b)
    if not diff <= atol:
        raise Refused(
            f"{what}: parameters differ from fuseloop's by {diff:.3g} "
            f"(> {atol}): not the same training"
        )
    return diff
