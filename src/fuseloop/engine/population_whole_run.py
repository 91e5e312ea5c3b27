"""Whole-run fusion for a population: many epochs per dispatch, every member in it
(docs/design.md §8 and §9).

`PopulationWholeRun` is `whole_run.WholeRun` with the member axis: the dispatch runs
`population_program.py`, and the host side keeps the population's record at each replayed
epoch exactly where `engine/run.py` keeps it for a per-epoch population run:

* before history, the members whose guard tripped in the epoch halt (from the
  dispatch's per-segment `active` record, not a read of the carry);
* the device-run `early_stop` and `reduce_lr_on_plateau` are replayed by their host
  references, one decision per member (`population_monitors.py`), checked against the
  device's per-member verdicts (a disagreement is a FusionError);
* after `epoch_completed`, the members a handler halted are frozen (already frozen on the
  device for the device's own stops), and the run ends when none is left.

With `restore_best`, each member's best step state lives on the device across the run's
dispatches: the handler's `MemberBest` tree goes in at a dispatch's start and comes back,
updated, before the dispatch's last epoch fires live; after that epoch's handlers, a
member whose best is that epoch gets the device's copy, made before a later handler (a
plateau) changed the state.

`validate` on resident data runs on the device too (every member's params through the
evaluator's population loop) and is replayed by merging its per-member metrics;
`checkpoint(criteria=...)` keeps each member's best states on the device and writes them
after the dispatch (`population_saves.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._copies import private_copy
from .._events import CONTINUE, HALT_LOOP, Registration
from .._metrics import VALIDATION_PREFIX
from .._population import population_record, silence_stopped
from .._sums import accumulator_dtype
from .device_monitors import _rates
from .device_replay import _disagree, _Substitutes
from .feeds import noting_dispatch
from .packing import segment_of
from .population import member_metrics
from .population_monitors import MemberBest, _select, plateau_decisions
from .population_program import population_whole_key, population_whole_program
from .population_saves import MemberSaves
from .whole_program import segments_for
from .whole_run import WholeRun

__all__ = ["PopulationWholeRun"]


class PopulationWholeRun(WholeRun):
    """The epochs of a population run over a resident source, many per dispatch."""

    def __init__(self, run: Any, size: int | None, warn_nonfinite: Any):
        super().__init__(run, size, warn_nonfinite)
        self.members = run.members  # population_run.PopulationHost
        self.population = run.population
        self.guard = False  # a member's guard freezes it; the dispatch goes on
        self.best_keyed = False  # `_hand_best` has made its first step for this dispatch

    # ----------------------------------------------------------------- the dispatch
    def _key(self, segments: int) -> Any:
        return population_whole_key(
            self.source, segments, self._piece(), self.work, self.replay.record
        )

    def _launch(self, state: Any, epoch: int, cursor: int) -> tuple[list[tuple[int, int]], Any]:
        run = self.run
        steps = self._steps(epoch, cursor)
        segments = segments_for(cursor, steps, self.limit)
        slots = self._slots(segments)
        self.rates = self._rate_tables(slots)  # shaped by the program (WholeRun._launch)
        self.member_reductions = np.zeros(self.population.size, np.int64)
        program = population_whole_program(
            run.programs,
            self.source,
            slots,
            self._piece(),
            self.work,
            self.replay.record,  # the records only where an iteration handler replays them
        )
        # The host read (WholeRun._advance) also holds the members active at each epoch's
        # end.
        with noting_dispatch(steps, epoch, cursor):
            extra, host = self._advance(program, cursor, steps, self._monitor_start(state))
        self.best_keyed = False
        saver = self.work.saver
        self.member_saves = (
            None
            if saver is None
            else MemberSaves(saver.handler, extra["kept_ring"], host["kept_n"])
        )
        return segments, host

    def _monitor_start(self, state: Any) -> dict[str, Any]:
        """The device monitors' per-member records at the dispatch's start, and with
        `restore_best` each member's best step state so far.
        """
        size = self.population.size
        out: dict[str, Any] = {}
        for w in self.work.watchers:
            lists = state.handler_metadata.get(w.handler.monitor.key) or {}
            best = lists.get("best", [None] * size)
            out[w.kind] = {
                "best": np.asarray([0.0 if b is None else b for b in best], accumulator_dtype()),
                "has_best": np.asarray([b is not None for b in best], np.bool_),
                "wait": np.asarray(lists.get("wait", [0] * size), np.int32),
            }
            if w.kind == "reduce_lr_on_plateau":
                out[w.kind].update(
                    cooldown=np.asarray(lists.get("cooldown", [0] * size), np.int32),
                    k=np.zeros(size, np.int32),
                    reduced=np.zeros(size, np.bool_),
                )
        stopper = self.work.stopper
        if stopper is not None and stopper.handler.restore_best:
            out["best_start"], out["holds"] = self._best_start(stopper.handler, state)
        return out

    def _best_start(self, handler: Any, state: Any) -> tuple[Any, np.ndarray]:
        """Each member's best step state so far (a copy: the program keeps its own) and
        whether it is the member's best epoch's, as `early_stop_members` would judge it.
        """
        size = self.population.size
        record = state.handler_metadata.get(handler.monitor.key)
        best: MemberBest | None = handler._members
        if record is None or best is None or best.tree is None or len(best.keys) != size:
            fresh = private_copy(self.run.carry.step_state)
            return fresh, np.zeros(size, np.bool_)
        keys = list(zip(record["best_epoch"], record["best"], strict=True))
        holds = np.asarray([best.keys[i] == keys[i] for i in range(size)], np.bool_)
        return private_copy(best.tree), holds

    def _rate_tables(self, epochs: int) -> tuple[np.ndarray, np.ndarray]:
        """Each member's learning rates after 0, 1, ... `epochs` reductions, computed on
        the host as the host handler computes them, and whether each is at `min_lr`.
        """
        size = self.population.size
        w = self.work.plateau
        if w is None:
            return np.zeros((size, 1), np.float32), np.zeros((size, 1), np.bool_)
        # Host read: the members' learning rates, once per dispatch (N scalars).
        now = np.asarray(jax.device_get(_rates(self.run.carry.step_state)[0])).reshape(-1)
        tables, floors = [], []
        for rate in now:
            rates = [np.asarray(rate)]
            for _ in range(epochs):
                rates.append(w.handler.next_rate(rates[-1]))
            tables.append(np.stack(rates))
            floors.append([w.handler.at_floor(r) for r in rates])
        return np.stack(tables), np.asarray(floors, np.bool_)

    # ----------------------------------------------------------------- the replay
    def _substitutes(self, state: Any, epoch: int, segment: int, live: bool) -> Any:
        host = self.host
        out: dict[Registration, Registration] = _Substitutes()
        v = self.work.validation
        if v is not None:
            acc = segment_of(host["validation"], segment)
            measured = member_metrics(v.loop.metrics, acc, self.population.size)
            out[v.registration] = dataclasses.replace(v.registration, handler=_merged(measured))
        for w in self.work.watchers:
            if w.kind == "early_stop":
                handler = _verified_stop(w.handler, np.asarray(host["stop"][segment]), live)
            elif w.kind == "checkpoint":
                assert self.member_saves is not None  # made by the dispatch with a saver
                handler = self.member_saves.replayed(np.asarray(host["saved"][segment], bool), live)
            else:
                table = self.rates[0]
                now = [table[i][self.member_reductions[i]] for i in range(table.shape[0])]
                reduced = np.asarray(host["reduced"][segment], bool)
                handler = _verified_plateau(w.handler, reduced, now)
                self.member_reductions += reduced
            out[w.registration] = dataclasses.replace(w.registration, handler=handler)
        if live:
            self._hand_best(state, epoch)
        return out

    def _hand_best(self, state: Any, epoch: int) -> None:
        """`early_stop(restore_best=True)` gets each member's best step state the device
        kept, in two steps, as the solo run's `WholeRun._hand_best` is called twice:

        * before the dispatch's last epoch fires live: the device's tree, keyed for the
          members whose best epoch ran earlier in this dispatch (or before it);
        * after that epoch's handlers: a member whose best is that epoch gets the device's
          copy, made before later handlers changed the state (a plateau's reduced rate),
          in place of the live State the host handler copied after them.
        """
        stopper = self.work.stopper
        if stopper is None or self.best_state is None:
            return
        handler = stopper.handler
        size = self.population.size
        record = state.handler_metadata.get(handler.monitor.key) or {}
        old: MemberBest | None = handler._members
        keys = list(old.keys) if old is not None and len(old.keys) == size else [None] * size
        best_s = np.asarray(self.host["best_s"]).reshape(-1)
        live_s = int(np.count_nonzero(self.host["n_run"])) - 1
        if not self.best_keyed:
            for i in range(size):
                if 0 <= best_s[i] < live_s:
                    keys[i] = (record["best_epoch"][i], record["best"][i])
                elif best_s[i] == live_s:  # keyed after the live epoch's handlers
                    keys[i] = None
            handler._members = MemberBest(keys, self.best_state)
            self.best_keyed = True
            return
        assert old is not None  # made by the first step
        live_epoch = self.first_epoch + live_s
        take = np.asarray(
            [
                best_s[m] == live_s
                and keys[m] is not None
                and record["best_epoch"][m] == live_epoch
                for m in range(size)
            ],
            bool,
        )
        if take.any():
            handler._members = MemberBest(
                keys, _select(jnp.asarray(take), self.best_state, old.tree)
            )
        self.best_state = None  # handed over

    def _members_end(
        self, state: Any, epoch: int, status: str, segment: int | None
    ) -> tuple[Any, str]:
        active = None if segment is None else np.asarray(self.host["active"][segment], bool)
        state, every_member_halted = self.members.epoch_end(state, epoch, active)
        if every_member_halted:
            status = HALT_LOOP  # every member's guard tripped: the epoch is not complete
        return state, status

    def _members_after(self, state: Any, status: str) -> str:
        if self.members.after_handlers(state):
            return HALT_LOOP  # every member has halted (e.g. a per-member early_stop)
        return status


def _merged(measured: dict[str, Any]) -> Any:
    """`validate`'s replay: the device's per-member validation metrics, merged."""

    def merge(state: Any) -> Any:
        metrics = {VALIDATION_PREFIX + k: v for k, v in silence_stopped(state, measured).items()}
        return CONTINUE, state.replace(metrics={**state.metrics, **metrics})

    return merge


def _verified_stop(handler: Any, device_stop: np.ndarray, live: bool) -> Any:
    """The host's per-member `early_stop` (the reference), checked against the members
    the device stopped this epoch.
    """

    def verified(state: Any) -> Any:
        before = np.asarray(population_record(state)["halted"], bool)
        status, state = handler(state if live else state.replace(step_state=None))
        stopped = np.asarray(population_record(state)["halted"], bool) & ~before
        if not np.array_equal(stopped, device_stop):
            raise _disagree("early_stop", handler.monitor, state.epoch)
        return status, state

    return verified


def _verified_plateau(handler: Any, device_reduced: np.ndarray, rates: list[Any]) -> Any:
    """The host's per-member plateau decisions (the reference) on the epoch's metrics; the
    rates themselves were changed on the device.
    """

    def verified(state: Any) -> Any:
        state, reduce = plateau_decisions(handler, state, lambda i: rates[i])
        if not np.array_equal(reduce, device_reduced):
            raise _disagree("reduce_lr_on_plateau", handler.monitor, state.epoch)
        return CONTINUE, state

    return verified
