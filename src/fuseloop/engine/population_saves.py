"""`checkpoint(criteria=...)` for a population inside a multi-epoch dispatch
(docs/design.md §8 and §9).

On the device each member keeps its own ring of best step states (`device_checkpoint`'s
ring, vmapped: `[members, ring, ...]`, with each member's count of kept improvements).
After the dispatch the host replays the per-member checkpoint monitor on each epoch (the
reference; a disagreement is a FusionError) and, for each member that improved, saves
`state.member(i)` under `<path>/member_<i>/` with the step state the device kept for that
improvement, as the unfused population run saves it. With `keep=N`, an improvement of a
member that N later ones of the same member in the same dispatch prune is numbered but not
written, as for a solo run (`device_checkpoint.py`). The dispatch's last epoch, which fires
live, saves the kept copy too: the carry has the cuts of the device-run handlers after the
checkpoint already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._events import CONTINUE
from .._fusion import FusionError
from .._json_tree import as_weak, is_weak
from .population_monitors import member_improvements, member_saver

__all__ = ["MemberSaves"]


class MemberSaves:
    """The host side of one dispatch: member i kept `kept[i]` improvements in `ring[i]`."""

    def __init__(self, saver: Any, ring: Any, kept: np.ndarray):
        self.saver, self.ring = saver, ring
        self.kept = np.asarray(kept).reshape(-1)
        self.size = jax.tree.leaves(ring)[0].shape[1]
        self.seen = np.zeros(self.kept.shape, np.int64)  # improvements replayed, per member

    def replayed(self, device_saved: np.ndarray, live: bool) -> Callable[[Any], Any]:
        """The checkpoint handler of one epoch's replay (`live`: the dispatch's last
        epoch, whose step state is the carry's: its leaves' weak types are kept).
        """

        def verified(state: Any) -> Any:
            state, improved = member_improvements(self.saver, state)
            if not np.array_equal(improved, device_saved):
                monitor = self.saver.monitor
                raise FusionError(
                    f"checkpoint(criteria={monitor.monitor!r}): the device and the host "
                    f"disagree on which members improved at epoch {state.epoch}; run with "
                    f"fuse=K at most the epoch's length to checkpoint on the host"
                )
            for i in (int(i) for i in np.flatnonzero(improved)):
                self.seen[i] += 1
                self._save(state, i, live)
            return CONTINUE, state

        return verified

    def _save(self, state: Any, i: int, live: bool) -> None:
        saver = member_saver(self.saver, i)
        k = int(self.seen[i]) - 1
        if k < self.kept[i] - self.size:  # a later save of this dispatch prunes it
            saver.skip()
            return
        kept = jax.tree.map(lambda a: a[i, k % self.size], self.ring)
        if live:  # as the carry's leaves are: a Python float's weak type kept
            weak = jax.tree.map(is_weak, state.member(i).step_state)
            kept = jax.tree.map(lambda a, w: as_weak(a) if w else a, kept, weak)
        saver.save(state.replace(step_state=None).member(i).replace(step_state=kept))
