"""A population State's bookkeeping: its record, one member as a solo State, and halting
members (docs/design.md §8).

A population State keeps a record in `handler_metadata["_population"]` (so checkpoints
save it): the size, the seeds, the per-member hyperparameters, which members have halted
and the last epoch each halted member's history holds, and which handler records hold one
entry per member.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._arg_types import is_int

POPULATION_KEY = "_population"  # a population State's record in handler_metadata
State = Any  # a fuseloop State (this module sits below _state, which imports it)

__all__ = [
    "POPULATION_KEY",
    "member_state",
    "stop_members",
    "halt_members",
    "population_record",
    "per_member",
    "refuse_population",
    "silence_stopped",
]


def population_record(state: State) -> dict[str, Any]:
    """The State's population record, or a ValueError saying it is a solo State."""
    record = state.handler_metadata.get(POPULATION_KEY)
    if record is None:
        raise ValueError(
            "this State is not a population's: member(i) needs a State from run(..., population=N)"
        )
    return record


def refuse_population(state: State, argument: str, instead: str = "") -> None:
    """Raises a ValueError where `state` (given as `argument`) is a population's State but
    its taker needs one member's; the message points to `state.member(i)`, then to `instead`
    (where `{size}` becomes the member count)."""
    size = getattr(state, "population", None)
    if size is None:
        return
    raise ValueError(
        f"{argument} is the State of a population of {size} members (run(..., "
        f"population={size})), whose params have a leading member axis, but one member's "
        f"State is needed here: pass state.member(i) for member i in [0, {size})"
        + instead.format(size=size)
    )


@jax.jit
def _take(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda a: a[i], tree)


def _pick(value: Any, i: int, size: int) -> Any:
    """Member i's entry of a per-member value (an array or list of length `size`)."""
    if isinstance(value, list) and len(value) == size:
        return value[i]
    shape: tuple[int, ...] = tuple(np.shape(value)) if hasattr(value, "shape") else ()
    if len(shape) >= 1 and shape[0] == size:
        picked = np.asarray(value)[i]
        return float(picked) if picked.ndim == 0 else picked
    return value


def member_state(state: State, i: int) -> State:
    """Member `i` of a population State as a solo State (see `State.member`)."""
    record = population_record(state)
    size = int(record["size"])
    if not is_int(i) or not 0 <= i < size:
        raise ValueError(f"member({i!r}): a member index must be an int in [0, {size})")
    i = int(i)
    halted = bool(record["halted"][i])
    last = record["last_epoch"][i]
    history = {
        e: {k: _pick(v, i, size) for k, v in metrics.items()}
        for e, metrics in state.history.items()
        if not halted or last is None or e <= last
    }
    metrics = {k: _pick(v, i, size) for k, v in state.metrics.items()}
    if halted and last is not None and last in history:
        metrics = dict(history[last])  # its own last epoch's
    per = set(record.get("per_member", []))
    metadata = {
        key: _member_record(value, i, size) if key in per else value
        for key, value in state.handler_metadata.items()
        if key != POPULATION_KEY
    }
    # A record a solo run writes only once it has a value (a restored best epoch) is
    # absent, not None, as in the member's solo run.
    metadata = {k: v for k, v in metadata.items() if not (k in per and v is None)}
    step_state = state.step_state
    if step_state is not None:
        step_state = _take(step_state, np.int32(i))
    changes: dict[str, Any] = {
        "step_state": step_state,
        "metrics": metrics,
        "history": history,
        "handler_metadata": metadata,
    }
    if halted:
        changes["status"] = "halted"
        within = (record.get("halted_in") or [None] * size)[i]  # absent from older saves
        if within is not None:
            changes["epoch"] = int(within)
        elif last is not None:
            changes["epoch"] = max(int(last), 0)
    return state.replace(**changes)


def _member_record(value: Any, i: int, size: int) -> Any:
    if isinstance(value, dict):
        picked = {k: _pick(v, i, size) for k, v in value.items()}
        # early_stop's solo record has a stopped epoch only once it stopped.
        return {k: v for k, v in picked.items() if not (k == "stopped_epoch" and v is None)}
    return _pick(value, i, size)


def halt_members(
    state: State, stopped: Any, last_epoch: int, halted_in: int | None = None
) -> State:
    """`state` with the members where `stopped` is True (and not halted yet) halted, their
    history ending at `last_epoch`, in epoch `halted_in` (by default `last_epoch`: a member
    stopped at an epoch's end; one whose loss went non-finite halts inside the epoch after
    its history's last, as its solo run's State says).
    """
    record = dict(population_record(state))
    mask = np.asarray(stopped, bool).reshape(-1)
    if mask.shape != (int(record["size"]),):
        raise ValueError(
            f"stop_members: expected {record['size']} flags (one per member), got {mask.shape}"
        )
    halted, last = list(record["halted"]), list(record["last_epoch"])
    within = list(record.get("halted_in") or [None] * len(halted))
    for i in np.flatnonzero(mask):
        if not halted[i]:
            halted[i], last[i] = True, int(last_epoch)
            within[i] = int(last_epoch if halted_in is None else halted_in)
    record.update(halted=halted, last_epoch=last, halted_in=within)
    return state.replace(handler_metadata={**state.handler_metadata, POPULATION_KEY: record})


def stop_members(state: State, stopped: Any) -> State:
    """See `State.stop_members`: halted at this epoch (its history ends here)."""
    return halt_members(state, stopped, state.epoch)


def per_member(state: State, key: str) -> State:
    """Marks `handler_metadata[key]` as holding one entry per member (member(i) picks its
    own)."""
    record = dict(population_record(state))
    keys = list(record.get("per_member", []))
    if key in keys:
        return state
    record["per_member"] = keys + [key]
    return state.replace(handler_metadata={**state.handler_metadata, POPULATION_KEY: record})


def silence_stopped(state: State, metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` (per-member arrays measured at `state.epoch`) with NaN for the members that
    halted before it: a frozen member's validation is not a value of the epoch, as its
    training metrics are not (docs/design.md §8).

    Example:
        >>> s = fl.State(epoch=2, handler_metadata={"_population": {"size": 2,
        ...     "halted": [False, True], "last_epoch": [None, 1]}})
        >>> silence_stopped(s, {"v": np.array([0.5, 0.7])})["v"].tolist()
        [0.5, nan]
    """
    record = state.handler_metadata.get(POPULATION_KEY)
    if record is None:
        return metrics
    stopped = np.array(
        [
            h and last is not None and last < state.epoch
            for h, last in zip(record["halted"], record["last_epoch"], strict=True)
        ],
        bool,
    )
    if not stopped.any():
        return metrics
    return {k: np.where(stopped, np.nan, np.asarray(v, np.float64)) for k, v in metrics.items()}
