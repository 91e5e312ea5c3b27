"""`Carry`: the one owner of the device-side carry during a run (docs/design.md §2).

The carry is the step state plus the metric accumulators (the "tail"). Programs take it,
donate it and return the next one; only `Carry` holds the current one. Handlers see the
step state through the State they are given and hand a new one back through their return
value, which `Handoff` passes to `adopt` — nothing else assigns the carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._copies import private_copy
from .._placement import device_signature

__all__ = ["Carry"]


class Carry:
    """The current step state and accumulators, and the programs that advance them."""

    def __init__(self, placement: Any, programs: Any, reads: Any, stats: dict[str, Any]):
        self.placement, self.programs, self.reads, self.stats = placement, programs, reads, stats
        self.step_state: Any = None
        self.tail: Any = None
        self._metrics: dict[str, float] | None = None
        self._queued = 0
        self.ended: Any = None  # the ending epoch's accumulators, once the next one opened
        # What to make for a later start once a program is launched, while the host
        # waits for the device (spares: docs/design.md §6).
        self._spare_makers: list[Callable[[], None]] = []
        # `(step state, tail, packed copy of them)` from the last launch of a program that
        # copies its carry (`Programs.copies`): the snapshot while that carry is current.
        self._copy: tuple[Any, Any, Any] | None = None
        # Which handler returned the step state no step has taken yet (`adopt`), or None.
        self._adopted_from: str | None = None

    def start(
        self,
        step_state: Any,
        made_here: bool = False,
        spare_maker: Callable[[], None] | None = None,
    ) -> None:
        """Takes the run's initial step state (`made_here`: a compiled program's output);
        `spare_maker` makes the next run's, once a chunk is launched."""
        self.step_state = self.placement.put_state(step_state, made_here)
        if spare_maker is not None:
            self._spare_makers.append(spare_maker)

    def reset_metrics(self) -> None:
        tail, spare_maker = self.programs.epoch_tail()
        if spare_maker not in self._spare_makers:
            self._spare_makers.append(spare_maker)
        if self.tail is not None and "active" in self.tail:
            tail = {**tail, "active": self.tail["active"]}  # a population's stopped members
        self.tail = self.placement.put_state(tail, made_here=True)
        self._metrics = {}

    def open_epoch(self) -> None:
        """The next epoch starts before the ending one's metrics are read: its accumulators
        are kept for `epoch_metrics`, and the next epoch steps on fresh ones.
        """
        self.ended = self.tail
        self.reset_metrics()

    def ending_tail(self) -> Any:
        """The ending epoch's tail: set aside by `open_epoch`, or the live one."""
        return self.tail if self.ended is None else self.ended

    def epoch_metrics(self) -> dict[str, float]:
        """The ending epoch's metrics: the live ones, or those kept by `open_epoch`."""
        if self.ended is None:
            return self.metrics()
        ended, self.ended = self.ended, None
        return self._read(ended)  # the next epoch already runs

    def stop_members(self, stopped: Any) -> None:
        """Freezes the population members where `stopped` (bool[N], host) is True."""
        from .population import deactivate

        self.tail = deactivate(self.tail, stopped)

    def adopt(self, step_state: Any, returned_by: str = "a handler", was: Any = None) -> None:
        """Takes a step state a handler returned, or wrote into in place (the carry's own,
        changed: `was` is what it held before); it is copied, since the next step donates
        it and the handler may still hold its arrays. `returned_by` names the handler's
        event, for an error of the next step that a new layout causes.
        """
        if step_state is None or (step_state is self.step_state and was is None):
            return
        old = self.step_state if was is None else was
        if device_signature(step_state) != device_signature(old):  # not a ragged batch's
            self._adopted_from = returned_by
        self.step_state = self.placement.put_state(private_copy(step_state))

    def advance(self, program: Any, *args: Any, copies: bool = False) -> tuple[Any, ...]:
        """Runs `program(step_state, tail, *args)`, keeps the new carry, and returns the
        program's other outputs (records, steps run, ...). One dispatch. `copies`: the
        program's last output is a packed copy of the new carry (`Programs.copies`).
        """
        try:
            out = program(self.step_state, self.tail, *args)
        except ValueError as error:  # XLA's own words for it name nothing of the user's
            if "donate the same buffer twice" in str(error):
                raise _shared_arrays_error() from error
            if self._adopted_from is not None and _CHANGED_LEAVES in str(error):
                error.add_note(_handed_back_note(self._adopted_from))
            raise
        self._adopted_from = None  # the step took the state a handler returned
        self.step_state, self.tail = out[0], out[1]
        if copies:
            self._copy, out = (out[0], out[1], out[-1]), out[:-1]
        self._metrics = None
        self._queued += 1
        self.stats["dispatches"] += 1
        if self._spare_makers:  # made while the host waits for this launch (host.py)
            self.reads.before_waiting(self._spare_makers)
            self._spare_makers = []
        return out[2:]

    def throttle(self, max_queued: int) -> None:
        """Waits for the queued dispatches once `max_queued` have been launched since the
        last wait, so the host stays at most that far ahead (no value is read).
        """
        if self._queued >= max_queued:
            jax.block_until_ready(self.tail)
            self._queued = 0

    def snapshot(self) -> Any:
        """A packed device copy of the carry, taken before a launch that a halt may have to
        undo: the copy the last launch made of it, while the carry is still that launch's
        (no dispatch), else a pack.
        """
        state, tail, packed = self._copy or (None, None, None)
        # `packed` is None where the carry is too large to copy every chunk.
        if packed is not None and state is self.step_state and tail is self.tail:
            return packed
        return self.programs.pack((self.step_state, self.tail))

    def restore(self, snapshot: Any) -> None:
        """Rolls back to `snapshot`: the dispatch launched after it is dropped (and does not
        count).
        """
        carry = self.programs.unpack(snapshot, (self.step_state, self.tail))
        self.step_state, self.tail = self.placement.put_state(carry, made_here=True)
        self._metrics = None
        # A snapshot is taken before any opening of the next epoch (`open_epoch`), so the
        # restored tail is the ending epoch's own: nothing is set aside any more.
        self.ended = None
        self.stats["dispatches"] -= 1

    def metrics(self) -> dict[str, float]:
        """The accumulated metrics now (read once per dispatch, when first asked for)."""
        if self._metrics is None:
            self._metrics = self._read(self.tail)  # a handler, or the epoch's end
        return self._metrics

    def _read(self, tail: Any) -> dict[str, float]:
        # Host read: the metrics of `tail`'s accumulators.
        return self.reads.metrics_of(self.reads.get(tail["acc"]))

    @property
    def metrics_if_read(self) -> dict[str, float] | None:
        """The live metrics if something already read them since the last dispatch."""
        return self._metrics

    def nonfinite(self) -> bool:
        # Host read: terminate_on_nan in an unfused loop checks every step.
        return bool(self.reads.get(self.tail["nonfinite"]))


def _shared_arrays_error() -> ValueError:
    """What a step state holding one array in two places is told: each step updates every
    leaf in place, and one buffer cannot be updated as two."""
    return ValueError(
        "the step state holds one array in two places (two leaves are the same array), and "
        "each step updates every leaf in place: give each leaf an array of its own "
        "(jax.tree.map(jnp.copy, tree) copies them)"
    )


# How `_fusion`'s refusal of a step that changes its step state's leaves begins.
_CHANGED_LEAVES = "the step changed its step state's leaves"


def _handed_back_note(returned_by: str) -> str:
    return (
        f"fuseloop: the step started from the step state {returned_by} returned, whose "
        f"leaves differ from those the step returns: that handler should return a step "
        f"state of the step's own structure, shapes and dtypes (e.g. "
        f"{{**state.step_state, 'w': new_w.astype(old_w.dtype)}}, no new or dropped keys)"
    )
