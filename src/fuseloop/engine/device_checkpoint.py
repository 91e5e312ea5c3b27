"""`checkpoint(criteria=...)` inside a multi-epoch dispatch (docs/design.md §9).

On the device, each epoch whose monitored metric improves (the same comparison as the
host's `Monitor`, on the same value) copies the step state into a ring of kept
states. After the dispatch the host replays the checkpoint handler on each epoch: it runs
the host monitor (the reference; a disagreement is a FusionError) and, at each improvement,
writes the State of that epoch with the step state the device kept for it. So does the
dispatch's last epoch, which fires live: its step state is the carry's, which the
device-run handlers after the checkpoint (a plateau's cut) have changed already.

The ring holds `min(segments, keep, what fits in RING_BUDGET_BYTES)` states. With
`keep=N`, an improvement that N later ones of the same dispatch would prune is numbered
but not written (`Checkpointer.skip`), so the directory ends as the unfused run leaves it.
When the ring is smaller than both the dispatch and `keep` (a large model), the dispatch
ends as soon as the ring is full, so no improvement is ever lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._events import CONTINUE
from .._fusion import FusionError
from .._json_tree import as_weak, is_weak
from .._placement import tree_bytes

__all__ = ["RING_BUDGET_BYTES", "BestSaves", "keep_best", "kept_start", "ring_size"]

RING_BUDGET_BYTES = 64 * 2**20


def ring_size(keep: int | None, segments: int, state: Any) -> tuple[int, bool]:
    """`(states kept, whether a full ring ends the dispatch)` for a dispatch of
    `segments` epoch pieces.
    """
    per_state = tree_bytes(state)
    fits = max(1, RING_BUDGET_BYTES // max(per_state, 1))
    size = max(1, min(segments, fits, keep or segments))
    return size, size < segments and (keep is None or size < keep)


def kept_start(keep: int | None, segments: int, state: Any) -> dict[str, Any]:
    """The ring's part of the device's epoch-end record at a dispatch's start."""
    size, flushes = ring_size(keep, segments, state)
    ring = jax.tree.map(lambda a: jnp.zeros((size,) + a.shape, a.dtype), state)
    out: dict[str, Any] = {"kept_ring": ring, "kept_n": jnp.zeros((), jnp.int32)}
    if flushes:
        out["flush"] = jnp.zeros((), jnp.bool_)
    return out


def keep_best(extra: dict[str, Any], state: Any, improved: Any) -> dict[str, Any]:
    """Copies `state` into the ring's next slot when `improved`."""
    ring, n = extra["kept_ring"], extra["kept_n"]
    size = jax.tree.leaves(ring)[0].shape[0]

    def put(ring: Any) -> Any:
        return jax.tree.map(
            lambda r, a: lax.dynamic_update_index_in_dim(r, a, n % size, 0), ring, state
        )

    extra = {**extra, "kept_ring": lax.cond(improved, put, lambda r: r, ring)}
    extra["kept_n"] = n + improved.astype(jnp.int32)
    if "flush" in extra:
        extra["flush"] = extra["kept_n"] >= size
    return extra


class BestSaves:
    """The host side for one dispatch: `kept` improvements were kept in `ring`; `carry`
    is the step state the dispatch carried (its leaves' weak types)."""

    def __init__(self, handler: Any, ring: Any, kept: int, carry: Any):
        self.handler, self.ring, self.kept = handler, ring, kept
        self.size = jax.tree.leaves(ring)[0].shape[0]
        # The ring's slices are strongly typed; a Python float of the step state is weak,
        # and a resume from the save must promote as the uninterrupted run does.
        self.weak = jax.tree.map(is_weak, carry)
        self.seen = 0  # improvements replayed so far in this dispatch

    def replayed(self, device_saved: bool) -> Callable[[Any], Any]:
        """The checkpoint handler of one epoch's replay."""

        def verified(state: Any) -> Any:
            # The live epoch's step state is the carry's, which the device-run handlers
            # after the checkpoint (a plateau's cut) changed already: its save, too, is
            # the copy the device kept at the checkpoint's place in the order.
            status, changed = self._judged(state, device_saved)
            if status == "improved":
                k = self.seen - 1
                if k < self.kept - self.size:  # a later save of this dispatch prunes it
                    self.handler.skip()
                else:
                    kept = jax.tree.map(
                        lambda a, weak: as_weak(a[k % self.size]) if weak else a[k % self.size],
                        self.ring,
                        self.weak,
                    )
                    self.handler.save(changed.replace(step_state=kept))
            return CONTINUE, changed

        return verified

    def _judged(self, state: Any, device_saved: bool) -> tuple[str, Any]:
        changed, improved = self.handler.judge(state)
        if improved != device_saved:
            monitor = self.handler.monitor
            raise FusionError(
                f"checkpoint(criteria={monitor.monitor!r}): the device and the host disagree "
                f"on whether epoch {state.epoch} improved; run with fuse=K at most the "
                f"epoch's length to checkpoint on the host"
            )
        if improved:
            self.seen += 1
        return ("improved" if improved else "same"), changed
