"""`Handoff`: handlers see the carry through their State and hand changes back; this is
the one place those changes reach the carry (docs/design.md §2, one owner of the carry).
"""

from __future__ import annotations

from typing import Any

import jax

from .._events import Event
from .._step_state_check import refuse_returned_layout
from .._warn import warn

__all__ = ["Handoff"]


class Handoff:
    """Fires events with the live step state and adopts a step state a handler returns."""

    def __init__(self, bus: Any, carry: Any):
        self.bus, self.carry = bus, carry
        self._told_discarded = False

    def fire(
        self, event: Event, state: Any, mirror_history: bool = False, substitute: Any = None
    ) -> tuple[str, Any]:
        """A run or epoch event: handlers see (and may replace) the live step state."""
        if not self.bus.has(event):  # counted and observed; no handler can change a thing
            return self.bus.fire(event, state, mirror_history)
        given = self.carry.step_state
        before = jax.tree.flatten(given)  # its leaves held, not their ids (a freed id is reused)
        status, state = self.bus.fire(
            event, state.replace(step_state=given), mirror_history, substitute
        )
        self._adopt(state.step_state, given, before, f"of {event.value} at epoch {state.epoch}")
        return status, state

    def fire_iteration(
        self, event: Event, state: Any, iteration: int, metrics: Any, live: bool
    ) -> tuple[str, Any]:
        """An iteration event. Live (unfused): the handlers see the step state and may
        replace it. Replayed (fused): `step_state` is None and a returned one is ignored
        (the steps after it already ran).
        """
        step_state = self.carry.step_state if live else None
        # Only where a handler of this event may fire: an unfused step walks no tree else.
        before = jax.tree.flatten(step_state) if live and self.bus.has(event) else ([], None)
        status, fired = self.bus.fire_iteration(event, state, iteration, metrics, step_state)
        if fired is state:  # no handler fired
            return status, fired
        if live:
            at = f"of {event.value} at epoch {fired.epoch}, iteration {iteration}"
            self._adopt(fired.step_state, step_state, before, at)
        elif fired.step_state is not None and not self._told_discarded:  # it was given None
            self._told_discarded = True  # once per run: the same handler fires again
            warn(_discarded(event))
        return status, fired

    def _adopt(self, step_state: Any, given: Any, before: tuple[list[Any], Any], at: str) -> None:
        """Hands the carry the step state the handlers left: one returned, or the one given
        (`given`, whose leaves and structure were `before`) written into in place, which a
        built-in step's checks judge as they judge a returned one (`refuse_returned_layout`).
        """
        in_place = step_state is given and _changed(given, before[0])
        # Written into, then handed back in a copy: the bus compared the copy with the
        # written state, so the check is made here against the leaves from before.
        returned = step_state is not given and step_state is not None
        copied = self.bus.fixed and returned and _changed(given, before[0])
        was = jax.tree.unflatten(before[1], before[0]) if in_place or copied else None
        if was is not None and self.bus.fixed:
            subject = f"a handler {at} wrote into the step state in place: state.step_state"
            refuse_returned_layout(was, step_state, subject)
        self.carry.adopt(step_state, f"a handler {at}", was if in_place else None)


def _changed(step_state: Any, before: list[Any]) -> bool:
    """Whether `step_state`, the carry's own, holds other arrays than `before` (its leaves
    before the handlers fired): a handler wrote into it in place (`state.step_state["lr"] =
    lr`, returning None), and the arrays it wrote are the user's, to be copied before the
    next step donates them (`Carry.adopt`)."""
    after = jax.tree.leaves(step_state)
    return len(after) != len(before) or any(a is not b for a, b in zip(after, before, strict=True))


def _discarded(event: Event) -> str:
    return (
        f"an {event.value} handler returned a step state in a fused run: it is discarded, "
        f"since the chunk's later steps already ran (fused iteration handlers see "
        f"step_state=None). Change the step state from an epoch event "
        f"(e.g. epoch_completed), or run with fuse=False to change it at every iteration"
    )
