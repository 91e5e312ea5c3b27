"""The program of a user's own step, `fl.loop(step_fn, init_fn)`: `step_fn(batch,
step_state) -> step_state`, with what a JAX user's step often gets wrong told by name (a
pair or None returned, the arguments swapped, no step state given)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax

from ._step import Program

__all__ = ["custom_program"]


def _check_returned_state(state: Any, new_state: Any) -> None:
    """Refuses what a JAX user's step often returns instead of the new step state."""
    if new_state is None and state is not None:
        raise TypeError(
            "step_fn returned None: fl.loop's step returns the new step state (JAX arrays "
            "cannot be changed in place: build the new state and return it)"
        )
    pair = isinstance(new_state, tuple) and len(new_state) == 2
    given: object = jax.tree.structure(state)  # no stub for PyTreeDef: compare as objects
    if pair and given == jax.tree.structure(new_state[0]):
        raise TypeError(
            "step_fn returned a pair (step state, something else): fl.loop's step returns "
            "the step state alone. Keep a metric as an entry of a dict step state, e.g. "
            "{**state, 'loss': loss}, and track it with Loop.metric('loss')"
        )


# The errors a step raises where its batch and step state came the other way round:
# `x, y = batch` on a state dict, `state["w"]` on a tuple batch, jnp on a dict or tuple.
_SWAPPED = re.compile(
    r"values to unpack|indices must be|string ind|not a valid JAX type|unsupported operand"
    r"|not subscriptable|requires ndarray or scalar arguments|Error interpreting argument"
)


_SWAPPED_NOTE = (
    "fuseloop: in case the arguments are swapped: fl.loop calls step_fn(batch, step_state), "
    "the batch first, then the step state"
)


def _key_of_the_other(error: KeyError, batch: Any, state: Any) -> bool:
    """Whether the key a step missed is one of the other argument's alone: `batch["params"]`
    on a dict batch, where the step state holds "params" (the arguments swapped); both are
    dicts, or a lookup of the other would not have raised a KeyError."""
    key = error.args[0] if len(error.args) == 1 else None
    if not (isinstance(batch, dict) and isinstance(state, dict)):
        return False  # a key looked up in a tuple raises a TypeError: another lookup failed
    try:
        return (key in batch) != (key in state)
    except TypeError:  # an unhashable key
        return False


def custom_program(step_fn: Callable[[Any, Any], Any], init_fn: Callable | None) -> Program:
    """A user loop: `step_fn(batch, step_state) -> step_state`."""

    def init(first_batch: Any, init_state: Any) -> Any:
        if init_fn is None:
            return init_state
        try:
            return init_fn(first_batch, init_state)
        except Exception as error:
            if init_state is None and "None" in str(error):  # init_fn read what it did not get
                error.add_note(_NO_INIT_STATE)
            raise

    batch_first = _names_the_batch_first(step_fn)

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        try:
            new_state = step_fn(batch, state)
        except (TypeError, ValueError, KeyError) as error:
            note = _note_on(error, batch, state, batch_first)
            if note is not None:
                error.add_note(note)
            raise
        _check_returned_state(state, new_state)
        aux: dict[str, Any] = {"step_state": new_state}
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            aux["y_true"] = batch[1]
        if isinstance(new_state, dict):
            if _labels_of_its_own(new_state):  # labels the step made (augmented)
                aux["y_true"] = new_state["y_true"]
            if "y_pred" in new_state:
                aux["y_pred"] = new_state["y_pred"]
            if "loss" in new_state:
                aux["loss"] = new_state["loss"]
        return new_state, aux

    return Program(init, step, True, "custom")


def _labels_of_its_own(state: dict[str, Any]) -> bool:
    """Whether the step state's "y_true" holds labels (those of its "y_pred"): any leaf with
    an axis. A "y_true" of scalars alone (a counter) is a value of its own, which
    `Loop.metric("y_true")` reads, not labels."""
    leaves = jax.tree.leaves(state.get("y_true"))
    return "y_pred" in state and any(getattr(leaf, "ndim", 0) >= 1 for leaf in leaves)


_NO_INIT_STATE = (
    "fuseloop: init_fn was called with init_state=None, since run was given none: "
    "loop.run(data, init_state) passes its init_state to init_fn(first_batch, init_state), "
    "e.g. loop.run(data, 0) for a seed"
)
_TRACED_STATE = (
    "fuseloop: every leaf of the step state is traced in the loop's compiled program, a "
    "Python bool or number in it too (an equinox module's `inference` flag): a step cannot "
    "branch on one in Python. Keep such values out of the step state (in the step's "
    "closure), branch with jax.lax.cond or jnp.where, or for an equinox module carry "
    "eqx.partition(model, eqx.is_array)'s arrays and eqx.combine them with the rest in the "
    "step"
)


_TRACED_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)
# jax names the traced argument and the function it traced: `state` of fuseloop's own step
# or chunk function is the step state (a user's jitted helper may call its argument state).
_STEP_STATE_TRACED = re.compile(r"tracing the function \w+ at \S*fuseloop\S* .*argument state")


def _names_the_batch_first(step_fn: Any) -> bool:
    """Whether `step_fn`'s first parameter is named for a batch (`batch`, `x`, ...): its
    author took fl.loop's order, so its errors are not of swapped arguments."""
    try:
        first = next(iter(inspect.signature(step_fn).parameters), "")
    except (TypeError, ValueError):  # no signature to read
        return False
    return "batch" in first.lower() or first in ("b", "x", "xy", "data", "inputs", "example")


def _note_on(error: Exception, batch: Any, state: Any, batch_first: bool) -> str | None:
    """What a step's error is told of its likely cause, or None."""
    if isinstance(error, KeyError):
        swapped = not batch_first and _key_of_the_other(error, batch, state)
        return _SWAPPED_NOTE if swapped else None
    if state is None:
        return (
            "fuseloop: the step state is None: give it to run, loop.run(data, init_state), "
            "or return it from fl.loop(step_fn, init_fn)'s init_fn"
        )
    if isinstance(error, _TRACED_ERRORS):
        return _TRACED_STATE if _STEP_STATE_TRACED.search(str(error)) else None
    if not batch_first and _SWAPPED.search(str(error)):  # a batch and a state dict swapped
        return _SWAPPED_NOTE
    return None
