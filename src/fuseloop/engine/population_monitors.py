"""The monitors of a population run, one decision per member (docs/design.md §8).

`early_stop` (with `restore_best`), `reduce_lr_on_plateau` and `checkpoint(criteria=...)`
each watch one metric. On a population that metric holds one value per member, and each
running member is decided exactly as its solo run decides: the handler's own arithmetic
(`Monitor.update`, `ReduceLROnPlateau.decide`) on the member's entry, with the member's own
record. The records hold one list entry per member and are marked per-member, so
`state.member(i)` sees the record its solo run would keep.

* `early_stop`: a member that stops halts at this epoch (the run freezes it). With
  `restore_best`, the step state of each member's best epoch is kept on the device (one
  select per epoch over the member axis), and a member gets it back when it stops, or
  when the run ends (a member still running at the last epoch: after that epoch's
  handlers, as its solo run does).
* `reduce_lr_on_plateau`: a member whose plateau is due gets its own learning rate lowered
  (the injected hyperparameter has a member axis), computed as the solo handler computes it.
* `checkpoint(criteria=...)`: each member keeps its own best. When member i improves,
  `state.member(i)` (a solo State) is saved under `<path>/member_<i>/`, the checkpoints its
  solo run would write under `<path>`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._copies import private_copy
from .._population import halt_members, per_member, population_record
from .._rate_groups import find_learning_rates, map_injected_rates
from .._state import RESTORED_KEY, without_restored
from .._types import Status
from .._warn import warn

__all__ = [
    "early_stop_members",
    "restore_members",
    "reduce_lr_members",
    "checkpoint_members",
    "plateau_decisions",
    "member_improvements",
    "member_saver",
    "MemberBest",
]

_MONITOR_FIELDS = {"best": None, "best_epoch": None, "wait": 0}


# ----------------------------------------------------------------- shared
def member_values(monitor: Any, state: Any) -> tuple[np.ndarray, np.ndarray]:
    """The monitored metric (float64, one value per member) and which members still run."""
    record = population_record(state)
    size = int(record["size"])
    if monitor.monitor not in state.metrics:
        monitor.value(state)  # raises the ValueError naming the metrics there are
    values = np.asarray(state.metrics[monitor.monitor], np.float64).reshape(-1)
    if values.shape != (size,):
        raise ValueError(
            f"monitor={monitor.monitor!r} holds {values.shape} values; a population "
            f"needs one per member ({size})"
        )
    return values, ~np.asarray(record["halted"], bool)


def _member_lists(state: Any, key: str, fields: dict[str, Any], size: int) -> dict[str, list]:
    saved = state.handler_metadata.get(key) or {}
    lists = {name: list(values) for name, values in saved.items()}
    for name, default in fields.items():
        lists.setdefault(name, [default] * size)
    return lists


def _mine(lists: dict[str, list], i: Any, names: Any) -> dict[str, Any]:
    return {name: lists[name][i] for name in names}


def _store(state: Any, key: str, lists: dict[str, list]) -> Any:
    state = state.replace(handler_metadata={**state.handler_metadata, key: lists})
    return per_member(state, key)


@jax.jit
def _select(mask: Any, new: Any, old: Any) -> Any:
    """Member-wise `new` where `mask`, else `old` (fresh buffers: the carry is donated)."""

    def pick(a: Any, b: Any) -> Any:
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, new, old)


# ----------------------------------------------------------------- early_stop
@dataclass
class MemberBest:
    """Each member's best epoch's step state (one device tree with the member axis)."""

    keys: list[Any]  # member i's copy: (best_epoch, best), or None
    tree: Any = None

    def keep(self, step_state: Any, improved: np.ndarray, keys: list[Any]) -> None:
        if self.tree is None:
            self.tree = private_copy(step_state)
        else:
            self.tree = _select(jnp.asarray(improved), step_state, self.tree)
        for i in np.flatnonzero(improved):
            self.keys[i] = keys[i]


def early_stop_members(stopper: Any, state: Any) -> tuple[Status, Any]:
    """`early_stop` on a population (see the module's docstring). Returns the handler's
    status: "halt_loop" once every member has halted.
    """
    monitor = stopper.monitor
    values, running = member_values(monitor, state)
    size = values.shape[0]
    if state.handler_metadata.get(monitor.key) is None:  # a fresh run: no earlier copies
        stopper._members = MemberBest([None] * size)
    fields = {**_MONITOR_FIELDS, "stopped_epoch": None}
    lists = _member_lists(state, monitor.key, fields, size)
    stop, improved = np.zeros(size, bool), np.zeros(size, bool)
    for i in np.flatnonzero(running):
        mine, improved[i] = monitor.update(
            _mine(lists, i, _MONITOR_FIELDS), float(values[i]), state.epoch
        )
        for name, value in mine.items():
            lists[name][i] = value
        stop[i] = not math.isfinite(values[i]) or 0 < mine["wait"] >= monitor.patience
        if stop[i]:
            lists["stopped_epoch"][i] = state.epoch
    state = _store(state, monitor.key, lists)
    broken = np.flatnonzero(running & ~np.isfinite(values))
    if broken.size:
        shown = values[broken[0]]
        monitor.warn_not_finite(shown, state.epoch, f" for members {broken.tolist()}")
    if stopper.restore_best:
        state = _keep_best(stopper, state, improved, lists)
        # A member that stops is frozen from here on, with its best epoch's step state. One
        # still running at the run's last epoch gets it when the run ends (`on_end`), as
        # its solo run does: this epoch's later handlers (a checkpoint) see its own.
        state, _ = _restore(stopper, state, stop)
    state = halt_members(state, stop, state.epoch)
    every = all(population_record(state)["halted"])
    return ("halt_loop" if every else "continue"), state


def begin_members(stopper: Any, state: Any, at_end: bool) -> None:
    """At a run's start (`EarlyStopping.begin`): a member whose best epoch is the State's
    last (a resume from that epoch's own State), whose best a restoring run handed back, or
    that stopped (frozen with its best restored), holds its best step state from the start,
    as its solo run does. A run that
    continues the last one keeps the copies it has. `at_end`: the State left off at an
    epoch's end (`_monitor_record.at_epoch_end`)."""
    record = state.handler_metadata.get(stopper.monitor.key)
    if record is None or not at_end:
        return
    size = len(record["best_epoch"])
    keys = [(record["best_epoch"][i], record["best"][i]) for i in range(size)]
    held: MemberBest | None = stopper._members
    held_keys = held.keys if held is not None and held.tree is not None else []
    if len(held_keys) == size and all(k is None or k == keys[i] for i, k in enumerate(held_keys)):
        return
    last, halted = max(state.history, default=None), population_record(state)["halted"]
    # A member whose best epoch's step state a restoring run handed back (RESTORED_KEY).
    restored = state.handler_metadata.get(RESTORED_KEY)
    restored = restored if isinstance(restored, (list, tuple)) else [None] * size
    held_best = [k[0] in (last, restored[i]) or halted[i] for i, k in enumerate(keys)]
    take = [k[0] is not None and held for k, held in zip(keys, held_best, strict=True)]
    stopper._members = MemberBest([k if t else None for k, t in zip(keys, take, strict=True)])
    if any(take):
        stopper._members.tree = private_copy(state.step_state)


def _keep_best(stopper: Any, state: Any, improved: np.ndarray, lists: dict[str, list]) -> Any:
    size = improved.shape[0]
    if stopper._members is None or len(stopper._members.keys) != size:
        # Resumed (the best epochs so far ran in an earlier run), or another population.
        stopper._members = MemberBest([None] * size)
    if improved.any() and state.step_state is not None:
        keys = [(lists["best_epoch"][i], lists["best"][i]) for i in range(size)]
        # A device copy (no host sync): the live arrays are donated by the next step.
        stopper._members.keep(state.step_state, improved, keys)
    return state


def restore_members(stopper: Any, state: Any) -> Any:
    """For the "completed" and "halted" events: every member gets its best epoch's step
    state, as each solo run does at its end (again for one restored when it stopped: it
    has been frozen since, so that is the same copy)."""
    if not stopper.restore_best or stopper._members is None:
        return state
    size = len(stopper._members.keys)
    record = state.handler_metadata.get(stopper.monitor.key) or {}
    # A stopped member was restored, and warned of, when it stopped: it is not warned again.
    stopped = np.asarray([e is not None for e in record.get("stopped_epoch", [None] * size)])
    state, taken = _restore(stopper, state, np.ones(size, bool), warn_for=~stopped)
    return _note_restored(state, record, taken)


def _restore(
    stopper: Any, state: Any, members: np.ndarray, warn_for: np.ndarray | None = None
) -> tuple[Any, np.ndarray]:
    """`state` with the step state of `members` replaced by their best epoch's copy, as
    `EarlyStopping._restored` does for a solo run (with its warning for a best epoch that
    ran in an earlier run, for the members of `warn_for`; None: every one), and which
    members took their copy.
    """
    best: MemberBest | None = stopper._members
    take = np.zeros(members.shape, bool)
    if best is None or len(best.keys) != members.shape[0] or state.step_state is None:
        return state, take
    record = state.handler_metadata.get(stopper.monitor.key) or {}
    for i in np.flatnonzero(members):
        key = (record["best_epoch"][i], record["best"][i]) if record else None
        if best.tree is not None and key is not None and best.keys[i] == key:
            take[i] = True
        elif key is not None and key[0] is not None and key[0] != state.epoch:
            if warn_for is not None and not warn_for[i]:
                continue
            warn(
                f"early_stop(restore_best=True): member {i}'s best epoch ({key[0]}) ran in "
                f"an earlier run, whose step state this one does not hold; the member keeps "
                f"its last epoch's",
                RuntimeWarning,
            )
    if not take.any():
        return state, take
    step_state = _select(jnp.asarray(take), best.tree, state.step_state)
    return state.replace(step_state=step_state), take


def _note_restored(state: Any, record: dict[str, Any], taken: np.ndarray) -> Any:
    """At the run's end, notes per member the best epoch whose step state it took (`taken`)
    where that is not the member's own last epoch (None elsewhere), as a solo State notes
    its own: `state.member(i)` then warns when resumed as a solo run does (engine/start.py
    `warn_on_resume`). A resumed population warns only of its running members: a halted
    one stays frozen."""
    population = population_record(state)
    last = max(state.history, default=None)
    size = taken.shape[0]
    best = record.get("best_epoch") or [None] * size
    own_last = [
        population["last_epoch"][i] if population["halted"][i] else last for i in range(size)
    ]
    restored = [
        int(best[i]) if taken[i] and best[i] not in (None, own_last[i]) else None
        for i in range(size)
    ]
    metadata = without_restored(state.handler_metadata)
    if all(epoch is None for epoch in restored):
        return state.replace(handler_metadata=metadata)
    state = state.replace(handler_metadata={**metadata, RESTORED_KEY: restored})
    return per_member(state, RESTORED_KEY)


# ----------------------------------------------------------------- reduce_lr_on_plateau
def reduce_lr_members(handler: Any, state: Any) -> tuple[Status, Any]:
    """`reduce_lr_on_plateau` on a population: each running member's plateau and learning
    rate, as its solo run's (see the module's docstring)."""
    state, reduce = plateau_decisions(handler, state, _LazyRates(state))
    if reduce.any():
        step_state = state.step_state
        opt_state = _set_member_rates(step_state["opt_state"], reduce, handler)
        state = state.replace(step_state={**step_state, "opt_state": opt_state})
    return "continue", state


def plateau_decisions(handler: Any, state: Any, rate: Any) -> tuple[Any, np.ndarray]:
    """Each running member's plateau decision (`rate(i)`: member i's learning rate, asked
    for only when its reduction is due): the State with the records updated, and which
    members reduce now. The rates themselves are left to the caller.
    """
    monitor = handler.monitor
    values, running = member_values(monitor, state)
    size = values.shape[0]
    fields = {**_MONITOR_FIELDS, "cooldown": 0, "reductions": 0}
    lists = _member_lists(state, monitor.key, fields, size)
    reduce = np.zeros(size, bool)
    for i in np.flatnonzero(running):
        mine = _mine(lists, i, fields)
        mine, reduce[i] = handler.decide(mine, float(values[i]), state.epoch, lambda i=i: rate(i))
        for name, value in mine.items():
            lists[name][i] = value
    return _store(state, monitor.key, lists), reduce


class _LazyRates:
    """The members' learning rates, read from the device only when a reduction is due."""

    def __init__(self, state: Any):
        self.state = state
        self.values: np.ndarray | None = None

    def __call__(self, i: int) -> Any:
        if self.values is None:
            step_state = self.state.step_state
            if not isinstance(step_state, dict) or "opt_state" not in step_state:
                raise ValueError(
                    "reduce_lr_on_plateau: the State has no optimizer state (it runs on "
                    "epoch events of a trainer loop)"
                )
            found = find_learning_rates(step_state["opt_state"])
            # Host read: the members' learning rates, only in an epoch with a reduction due.
            self.values = np.asarray(found[0]).reshape(-1)
        return self.values[i]  # a numpy scalar of the rate's dtype (see `at_floor`)


def _set_member_rates(opt_state: Any, reduce: np.ndarray, handler: Any) -> Any:
    """`opt_state` with the learning rate of the members in `reduce` lowered once, each as
    `set_learning_rate` lowers a solo run's (on the host in float64, cast once)."""

    def change(old: Any) -> Any:
        # Host read: the rates being lowered (an epoch with a reduction due).
        host = np.asarray(old)
        lowered = np.maximum(np.real(host).astype(np.float64) * handler.factor, handler.min_lr)
        return jnp.asarray(np.where(reduce, lowered.astype(host.dtype), host), old.dtype)

    return map_injected_rates(opt_state, change)


# ----------------------------------------------------------------- checkpoint(criteria=)
def checkpoint_members(saver: Any, state: Any) -> tuple[Status, Any]:
    """`checkpoint(criteria=...)` on a population: each running member whose metric
    improves is saved alone (`state.member(i)`) under `<path>/member_<i>/` by a saver of
    the same kind and options (see the module's docstring)."""
    state, improved = member_improvements(saver, state)
    for i in np.flatnonzero(improved):
        member_saver(saver, int(i)).save(state.member(int(i)))
    return "continue", state


def member_improvements(saver: Any, state: Any) -> tuple[Any, np.ndarray]:
    """The checkpoint monitor on each running member: the State with the records updated
    (each saved member holds its updated record, as a solo checkpoint-on-best does), and
    which members improved."""
    monitor = saver.monitor
    values, running = member_values(monitor, state)
    size = values.shape[0]
    lists = _member_lists(state, monitor.key, _MONITOR_FIELDS, size)
    improved = np.zeros(size, bool)
    for i in np.flatnonzero(running):
        mine, improved[i] = monitor.update(
            _mine(lists, i, _MONITOR_FIELDS), float(values[i]), state.epoch
        )
        for name, value in mine.items():
            lists[name][i] = value
    return _store(state, monitor.key, lists), improved


def member_saver(saver: Any, i: int) -> Any:
    """Member i's own saver: the same kind and options, under `<path>/member_<i>/`."""
    found = saver.members.get(i)
    if found is None:
        found = type(saver)(
            saver.path / f"member_{i}", keep=saver.keep, asynchronous=saver.asynchronous
        )
        saver.members[i] = found
    return found
