"""One monitor, three handlers: early stopping, LR on plateau, and checkpoint-on-best.

A `Monitor` watches one metric of `state.metrics` and keeps its best value and how many
epochs passed without improvement. That record lives in `state.handler_metadata` under the
handler's key, so it is saved with a checkpoint and a resumed run continues it exactly.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._copies import private_copy
from .._distributed import all_processes
from .._events import Event, Registration
from .._optim import abstract_state, has_schedule, set_learning_rate
from .._optim_probe import rate_is_scheduled, scheduled_hyperparams
from .._rate_groups import (
    find_learning_rates,
    fixed_rate_groups,
    inject_states,
    lowered_rate,
    rate_value,
    several_rates_error,
)
from .._state import RESTORED_KEY, State, without_restored
from .._step import _trainable
from .._types import Status
from .._warn import warn
from ..engine.population_monitors import (
    begin_members,
    early_stop_members,
    reduce_lr_members,
    restore_members,
)
from ._monitor_record import Monitor, at_epoch_end, check_float, check_int, resolve_mode

__all__ = ["Monitor", "EarlyStopping", "ReduceLROnPlateau", "find_learning_rates"]


class EarlyStopping:
    """Halts the loop after `patience` consecutive epochs without improvement.

    Keras semantics: the first epoch always sets the best value; every later epoch that does
    not beat it by more than `min_delta` adds one to the wait count, and the loop halts when
    the count reaches `patience`. A non-finite monitored value halts at once.

    With `restore_best=True` (Keras's `restore_best_weights`), the step state of each new
    best epoch is copied on the device, and when the run ends - this handler halts it, its
    last epoch completes, another handler or a signal ends it - the State it returns holds
    that copy (params, optimizer state, counters), bitwise: `on_end`, on the `completed`
    and `halted` events, which `handle_event` attaches along with the handler. The
    epoch's own handlers (a checkpoint) still see the epoch's step state, so a run resumed
    from its checkpoint is the run that went on.

    Example:
        >>> stop = EarlyStopping("validation_loss", patience=2, restore_best=True)
    """

    # One run at a time: it keeps its run's best step state (engine/serving.py).
    fuseloop_serves_one_run = True

    # The engine runs a twin of this handler on the device inside a multi-epoch dispatch
    # (engine/device_monitors.py) and checks it against this one, the reference.
    on_device = "early_stop"

    def __init__(
        self,
        monitor: str,
        patience: int = 3,
        mode: str = "min",
        min_delta: float = 0.0,
        key: str = "",
        restore_best: bool = False,
    ):
        if not isinstance(restore_best, bool):
            raise ValueError(f"restore_best={restore_best!r} must be True or False")
        mode = resolve_mode(mode, monitor, "monitor", "early_stop")
        self.monitor = Monitor(monitor, mode, patience, min_delta, key or f"early_stop:{monitor}")
        self.restore_best = restore_best
        self.fuseloop_serves_one_run = restore_best  # only its best copy is kept on it
        self._best: tuple[Any, Any] | None = None  # ((epoch, value), device copy)
        self._members: Any = None  # a population's best copies (engine/population_monitors)
        # The epoch times of the State this handler last saw (an epoch's end, a run's end):
        # a run that starts from another State (another run's, reusing this Loop) cannot be
        # the one its best copies belong to, whatever the best epoch and value; two runs'
        # wall times are never all equal (and, plain floats, compare where a population's
        # history holds arrays).
        self._seen: Any = None

    def fuseloop_companions(self, name: str) -> tuple[Registration, ...]:
        """What `handle_event` attaches with this handler, however it is attached.

        With `restore_best`: `begin` on "started" (on every process: each holds its own
        stopper) and `on_end` on "completed" and "halted".
        """
        if not self.restore_best:
            return ()
        label = name or "early_stop"
        begin = all_processes(self.begin)
        return (
            Registration(Event.STARTED, begin, name=f"{label}:begin", observes=True, own=True),
            Registration(Event.COMPLETED, self.on_end, name=f"{label}:restore", own=True),
            Registration(Event.HALTED, self.on_end, name=f"{label}:restore", own=True),
        )

    def __call__(self, state: State) -> tuple[Status, State]:
        """Records the monitored value; halts the run once it stopped improving."""
        self._seen = dict(state.times)
        if state.population is not None:  # one decision per member
            return early_stop_members(self, state)
        value = self.monitor.value(state)
        previous = self.monitor.record(state)
        if previous["best"] is None:  # a fresh run: nothing kept from an earlier one
            self._best = None
        record, improved = self.monitor.update(previous, value, state.epoch)
        if improved and self.restore_best and state.step_state is not None:
            # A device copy (no host sync): the live arrays are donated by the next step.
            self._best = ((state.epoch, value), private_copy(state.step_state))
        stop = not math.isfinite(value) or (
            record["wait"] > 0 and record["wait"] >= self.monitor.patience
        )
        if stop:
            record["stopped_epoch"] = state.epoch
        if not math.isfinite(value):
            self.monitor.warn_not_finite(value, state.epoch)
        # The best step state comes back when the run ends (`on_end`), not here: the
        # handlers after this one (a checkpoint) see this epoch's own step state, so a run
        # resumed from its checkpoint is the run that went on.
        return ("halt_loop" if stop else "continue"), self.monitor.store(state, record)

    def begin(self, state: State) -> None:
        """For the "started" event: the best step state a run starts with, if any.

        A run that continues the last one (from the State it ended with, whose record's
        best is the copy this handler kept) keeps that copy; a run resumed from its best
        epoch's own State (the checkpoint that epoch wrote), or from the State a restoring
        run returned (in another Loop, or loaded from disk), holds the best step state from
        its start; any other start has none yet.
        """
        if not self.restore_best or state.step_state is None:
            return
        if state.times != self._seen:  # not the State the last run ended with
            self._best, self._members = None, None
        if state.population is not None:
            begin_members(self, state, at_epoch_end(state))
            return
        record = self.monitor.record(state)
        if self._best is not None and self._best[0] == (record["best_epoch"], record["best"]):
            return
        self._best = None
        last = max(state.history, default=None)
        best = record["best_epoch"]
        # A State a restoring run returned holds its best epoch's step state (RESTORED_KEY).
        restored = best is not None and state.handler_metadata.get(RESTORED_KEY) == best
        if restored or (best is not None and best == last and at_epoch_end(state)):
            self._best = ((best, record["best"]), private_copy(state.step_state))

    def on_end(self, state: State) -> tuple[Status, State]:
        """For the "completed" and "halted" events: the best epoch's step state."""
        self._seen = dict(state.times)
        if state.population is not None:  # each member's own best epoch
            return "continue", restore_members(self, state)
        return "continue", self._restored(state)

    on_end.restores_best = True  # type: ignore[attr-defined]  # it sets RESTORED_KEY (bus.py)

    def _restored(self, state: State) -> State:
        if not self.restore_best:
            return state
        record = self.monitor.record(state)
        # Which epoch's step state the State holds, where it is not its last epoch's: a
        # run resumed from it would go on from there (engine/resume.py `warn_on_resume`).
        metadata = dict(without_restored(state.handler_metadata))  # written below
        if self._best is None or self._best[0] != (record["best_epoch"], record["best"]):
            if record["best_epoch"] is not None and record["best_epoch"] != state.epoch:
                warn(
                    f"early_stop(restore_best=True): the best epoch ({record['best_epoch']}) "
                    f"ran in an earlier run, whose step state this one does not hold; the "
                    f"State keeps the last epoch's",
                    RuntimeWarning,
                )
            return state.replace(handler_metadata=metadata)
        best_epoch = self._best[0][0]
        # Also noted where the run halted inside an epoch after the best one ended: the
        # step state is then that epoch's end, from which a resumed run starts cleanly.
        if best_epoch != max(state.history, default=best_epoch) or not at_epoch_end(state):
            metadata[RESTORED_KEY] = int(best_epoch)
        return state.replace(step_state=private_copy(self._best[1]), handler_metadata=metadata)


class ReduceLROnPlateau:
    """Multiplies the learning rate by `factor` after `patience` epochs on a plateau.

    Works with optimizers built by `optax.inject_hyperparams` (the named optimizers
    "sgd", "adam", "adamw" are). The new rate is written into the optimizer state, so it
    takes effect from the next step (the next chunk when fused). Keras semantics: after a
    reduction the wait count restarts and `cooldown` counts down from the next epoch, the
    epoch that brings it to 0 already counting (so `cooldown=N` leaves N - 1 epochs out);
    the rate never goes below `min_lr`, and once there the wait count goes on growing
    (no reduction restarts it).

    Example:
        >>> plateau = ReduceLROnPlateau("validation_loss", factor=0.5, patience=2)
    """

    def __init__(
        self,
        monitor: str,
        factor: float = 0.1,
        patience: int = 3,
        mode: str = "min",
        min_delta: float = 0.0,
        min_lr: float = 0.0,
        cooldown: int = 0,
        key: str = "",
    ):
        mode = resolve_mode(mode, monitor, "monitor", "reduce_lr_on_plateau")
        self.monitor = Monitor(
            monitor, mode, patience, min_delta, key or f"reduce_lr_on_plateau:{monitor}"
        )
        self.factor = check_float(factor, "factor", 0.0, 1.0, open_low=True, open_high=True)
        self.min_lr = check_float(min_lr, "min_lr", 0.0)
        self.cooldown = check_int(cooldown, "cooldown", 0)
        self._unprobed: Any = None  # an optimizer to probe on the run's params (`check_start`)

    def check_optimizer(self, program: Any) -> None:
        """Raises a ValueError now if the loop's learning rate cannot be changed later."""
        if getattr(program, "kind", None) != "trainer" or program.optimizer is None:
            raise ValueError(
                "reduce_lr_on_plateau needs a trainer loop (fl.trainer(...)): this loop has "
                "no optimizer whose learning rate it could change"
            )
        tx = program.optimizer
        scheduled = rate_is_scheduled(tx)
        if scheduled or (not _injected_rate(tx) and has_schedule(tx)):
            raise _scheduled_lr_error()
        # An optimizer whose structure depends on the params is probed on them when a
        # run starts (`check_start`).
        self._unprobed = tx if scheduled is None else None
        shapes = abstract_state(tx)
        if shapes is not None and not find_learning_rates(shapes):  # None: checked when run
            raise _fixed_lr_error(shapes)
        if shapes is not None and fixed_rate_groups(shapes):
            raise several_rates_error()
        whole = [r.dtype for r in find_learning_rates(shapes or ()) if _whole_number(r)]
        if whole:  # the rate was given as an int: a reduction would round it, 1 * 0.5 to 0
            raise ValueError(
                f"reduce_lr_on_plateau: this optimizer holds its learning rate as {whole[0]} "
                f"(it was given as an int), so a reduced rate would be rounded to a whole "
                f"number (1 * 0.5 to 0) and training would stop; give it as a float, e.g. "
                f"optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)"
            )

    # The engine runs a twin of this handler on the device inside a multi-epoch dispatch
    # (engine/device_monitors.py); `decide` is the arithmetic both share.
    on_device = "reduce_lr_on_plateau"

    def decide(
        self, record: dict[str, Any], value: float, epoch: int, rate: Any
    ) -> tuple[dict[str, Any], bool]:
        """The record after this epoch, and whether to reduce the rate now.

        `rate()` gives the current learning rate (asked for only when a reduction is due).
        """
        record = dict(record)
        record.setdefault("cooldown", 0)
        record.setdefault("reductions", 0)
        if record["cooldown"] > 0:
            record["cooldown"] -= 1
            record["wait"] = 0
        record, improved = self.monitor.update(record, value, epoch)
        if improved or record["cooldown"] > 0:
            if not improved:
                record["wait"] = 0
            return record, False
        if record["wait"] < self.monitor.patience:
            return record, False
        if self.at_floor(rate()):  # Keras's rule: the wait count goes on growing there
            return record, False
        record["wait"] = 0
        record["cooldown"] = self.cooldown
        record["reductions"] += 1
        return record, True

    def at_floor(self, rate: Any) -> bool:
        """Whether a reduction would leave `rate` where it is.

        `rate` is an array or numpy scalar of the rate's dtype: at the floor means at
        `min_lr` as that dtype holds it (float32 0.2 is above the Python 0.2), or below it.
        """
        return bool(rate_value(self.next_rate(rate)) >= rate_value(rate))

    def next_rate(self, rate: Any) -> Any:
        """The rate after one reduction, as `set_learning_rate` computes it."""
        return np.asarray(lowered_rate(rate, self.factor, self.min_lr), rate.dtype)

    def __call__(self, state: State) -> tuple[Status, State]:
        """Records the monitored value; lowers the learning rate once it stopped improving."""
        if state.population is not None:  # one plateau and one rate per member
            return reduce_lr_members(self, state)
        value = self.monitor.value(state)
        record, reduce = self.decide(
            self.monitor.record(state), value, state.epoch, lambda: self._rate(state)
        )
        if not reduce:
            return "continue", self.monitor.store(state, record)
        step_state = state.step_state
        opt_state = set_learning_rate(step_state["opt_state"], self.factor, self.min_lr)
        state = state.replace(step_state={**step_state, "opt_state": opt_state})
        return "continue", self.monitor.store(state, record)

    def check_start(self, step_state: Any) -> None:
        """Refuses a run whose optimizer's learning rate this handler cannot change.

        `check_optimizer` could not probe it without the params (`optax.masked`,
        `multi_transform` with pytree labels); here it is probed on the run's initial step
        state: a rate fixed inside the transformation, or a scheduled one that would
        overwrite every reduction, stops the run before it starts, in every fuse mode
        (the engine calls this for every run, `EventBus.check_start`).
        """
        tx = self._unprobed
        if tx is None or not isinstance(step_state, dict) or "params" not in step_state:
            return
        if "opt_state" in step_state and not find_learning_rates(step_state["opt_state"]):
            raise _fixed_lr_error(step_state["opt_state"])
        if fixed_rate_groups(step_state.get("opt_state", ())):
            raise several_rates_error()
        trainable, _ = _trainable(step_state["params"])  # what the trainer's init gives tx.init
        scheduled = scheduled_hyperparams(tx, trainable)
        if scheduled is None:  # a rate it would write might be overwritten in silence
            raise ValueError(
                "reduce_lr_on_plateau: fuseloop's probe of the optimizer (updates of small "
                "gradients on the model's params, until each optax.MultiSteps in it has "
                "applied) failed or never applied, so whether a schedule recomputes its "
                "learning rate (overwriting a reduced one) is unknown; check that a run "
                "without reduce_lr_on_plateau trains, and if it does, reduce the rate by "
                "hand: resume from the State with a lower injected learning_rate"
            )
        if "learning_rate" in scheduled:
            raise _scheduled_lr_error()
        self._unprobed = None  # probed once (eager work on the params) and found fine

    def _rate(self, state: State) -> Any:
        step_state = state.step_state
        if not isinstance(step_state, dict) or "opt_state" not in step_state:
            raise ValueError(
                "reduce_lr_on_plateau: the State has no optimizer state (it runs on epoch "
                "events of a trainer loop)"
            )
        rates = find_learning_rates(step_state["opt_state"])
        if not rates:
            raise _fixed_lr_error(step_state["opt_state"])
        return np.asarray(rates[0])  # its own dtype: `at_floor` compares in it


def _whole_number(rate: Any) -> bool:
    return not jnp.issubdtype(rate.dtype, jnp.inexact)  # numpy calls bfloat16 no float


def _injected_rate(tx: Any) -> bool:
    shapes = abstract_state(tx)
    return shapes is not None and bool(find_learning_rates(shapes))


def _scheduled_lr_error() -> ValueError:
    return ValueError(
        "reduce_lr_on_plateau cannot change this optimizer's learning rate: it is an optax "
        "schedule, recomputed at every step, so a reduced rate would be overwritten. Use a "
        "constant learning rate (e.g. optax.inject_hyperparams(optax.adam)(learning_rate="
        "1e-3), or a named optimizer) with reduce_lr_on_plateau, or drop it and keep the "
        "schedule"
    )


def _fixed_lr_error(opt_state: Any) -> ValueError:
    injected = sorted({name for n in inject_states(opt_state) for name in n.hyperparams})
    if injected:  # optax.inject_hyperparams, under another name than learning_rate
        return ValueError(
            f"reduce_lr_on_plateau changes the injected hyperparameter named learning_rate, "
            f"and this optimizer's optax.inject_hyperparams holds {injected}: name the rate "
            f"learning_rate, e.g. optax.inject_hyperparams(lambda learning_rate: "
            f"optax.adam(learning_rate))(learning_rate=1e-3)"
        )
    return ValueError(
        "reduce_lr_on_plateau cannot change this optimizer's learning rate: it is fixed "
        "inside the optax transformation. Build it with optax.inject_hyperparams, e.g. "
        "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), or pass a named "
        "optimizer ('sgd', 'adam', 'adamw')"
    )
