"""The plain arguments of `Loop.run`, checked before a run is built."""

from __future__ import annotations

from typing import Any

from .._arg_types import is_int
from .._events import ITERATION_EVENTS, marked_objects
from .._fusion import FusionError

__all__ = ["check_run_options", "refuse_step_state_readers"]


def check_run_options(
    epochs: Any, iterations: Any, jit: Any, progress: Any, max_in_flight: Any, prefetch: Any
) -> None:
    """Raises a ValueError naming the first bad `run(...)` argument (`Loop.run` calls it
    before anything else; `fuse` and `mesh` are checked by the run).
    """
    _check_count(epochs, "epochs", allow_none=False)
    _check_count(iterations, "iterations", allow_none=True)
    _check_count(max_in_flight, "max_in_flight", allow_none=False)
    if not is_int(prefetch) or prefetch < 0:
        raise ValueError(
            f"prefetch={prefetch!r} must be an int >= 0 (chunks pulled ahead "
            f"in a background thread; 0 pulls the next chunk in the caller)"
        )
    if not isinstance(jit, bool):
        raise ValueError(f"jit={jit!r} must be True or False")
    if not isinstance(progress, bool):
        raise ValueError(f"progress={progress!r} must be True or False")


def _check_count(value: Any, argument: str, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"{argument}={value!r} must be a positive int")


def refuse_step_state_readers(registrations: Any, fuse: Any) -> None:
    """Refuses, before anything runs, a fused run (`fuse`, as resolved: None is unfused)
    with a fuseloop handler that reads the step state at an iteration event (`checkpoint`,
    `validate`): a fused chunk runs whole on the device and its iteration events are
    replayed after it with `step_state` None, so the handler would fail at its first
    firing, after steps had trained."""
    if fuse is None:
        return
    for registration in registrations:
        if registration.event not in ITERATION_EVENTS or registration.observes:
            continue
        # The handler itself (a function holding a Checkpointer may only read its path).
        if marked_objects(registration.handler, "fuseloop_reads_step_state", held=False):
            raise FusionError(
                f"{registration.label} on {registration.event.value!r} reads the step state "
                "at that iteration, which a fused run does not keep (its chunks run whole on "
                "the device; their iteration events are replayed with step_state None): run "
                "with fuse=False, or attach it to an epoch event (the default)"
            )
