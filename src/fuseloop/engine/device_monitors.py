"""Epoch-end work done on the device inside a multi-epoch dispatch (docs/design.md §9).

Four handlers have device twins: `validate` on device-resident validation data (the
evaluator's own device loop over the validation set, accumulating sums and counts, its
short last batch as a step of its own shape), `early_stop` and `reduce_lr_on_plateau` (the
monitor's best, wait and decision, in float32) and `checkpoint(criteria=...)` (the best
step states kept on the device, written at the dispatch's end: `device_checkpoint.py`).
The host handlers stay the reference: after the dispatch the host replays each monitor on
each epoch's metrics and checks that it decides what the device decided (a disagreement
raises a FusionError, never a silent difference), and `validate` is replayed by merging the
device's validation accumulators, read the way an evaluator run reads them (the host
side: `device_replay.py`).

A handler is recognised by its `on_device` attribute ("validate", "early_stop",
"reduce_lr_on_plateau" or "checkpoint"); the engine imports no handler module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._events import ALWAYS, ITERATION_EVENTS, Event, Registration
from .._fusion import make_chunk_fn
from .._metrics import VALIDATION_PREFIX
from .._rate_groups import find_learning_rates, map_injected_rates
from .._step import init_tail, make_carry_step
from .._sums import accumulated, accumulator_dtype
from .device_checkpoint import keep_best, kept_start
from .device_compare import beats_best
from .programs import MIN_SLOTS

__all__ = ["DeviceWork", "plan_device_work"]

_WATCHED = ("early_stop", "reduce_lr_on_plateau", "checkpoint")


@dataclass(frozen=True)
class Validation:
    registration: Registration
    loop: Any  # the evaluator Loop
    source: Any  # its resident ArraySource

    @property
    def batches(self) -> int:
        return self.source.n // self.source.batch_size

    @property
    def short(self) -> int:
        """The rows of the short last batch the evaluator runs (0: none, or dropped)."""
        return self.source.short_batch


@dataclass(frozen=True)
class Watcher:
    """A device twin of `early_stop`, `reduce_lr_on_plateau` or `checkpoint(criteria=)`
    (`kind`, the handler's `on_device`).
    """

    kind: str
    registration: Registration
    handler: Any  # the host handler, the reference
    spec: Any  # the MetricSpec it monitors
    validation: bool  # the metric is `validation_<spec.name>`


@dataclass(frozen=True)
class DeviceWork:
    """The epoch-end work of a run's dispatches, in registration order; `key` identifies
    its programs.
    """

    validation: Validation | None
    watchers: tuple[Watcher, ...] = ()

    @property
    def key(self) -> tuple[Registration, ...]:
        return self.registrations

    @property
    def registrations(self) -> tuple[Registration, ...]:
        head = (self.validation.registration,) if self.validation else ()
        return head + tuple(w.registration for w in self.watchers)

    @property
    def stopper(self) -> Watcher | None:
        return next((w for w in self.watchers if w.kind == "early_stop"), None)

    @property
    def plateau(self) -> Watcher | None:
        return next((w for w in self.watchers if w.kind == "reduce_lr_on_plateau"), None)

    @property
    def saver(self) -> Watcher | None:
        return next((w for w in self.watchers if w.kind == "checkpoint"), None)


def _resident_validation(r: Registration) -> Validation | None:
    handler: Any = r.handler
    source: Any = getattr(handler, "data", None)
    if getattr(handler, "on_device", None) != "validate" or r.filter != ALWAYS:
        return None
    if not getattr(source, "resident", False):
        return None  # host-fed: validated on the host
    return Validation(r, handler.loop, source)


def _watcher(r: Registration, metrics: Any, validation: Validation | None) -> Watcher | None:
    handler: Any = r.handler
    kind = getattr(handler, "on_device", None)
    if kind not in _WATCHED or r.filter != ALWAYS:
        return None
    name = handler.monitor.monitor
    if validation is not None and name.startswith(VALIDATION_PREFIX):
        wanted = name.removeprefix(VALIDATION_PREFIX)
        for spec in validation.loop.metrics:
            if spec.name == wanted:
                return Watcher(kind, r, handler, spec, True)
    for spec in metrics:
        if spec.name == name:
            return Watcher(kind, r, handler, spec, False)
    return None


def plan_device_work(bus: Any, metrics: Any, step_state: Any) -> DeviceWork:
    """The `epoch_completed` handlers the device can run, in order: a resident `validate`
    first, then `early_stop`, `reduce_lr_on_plateau` and `checkpoint(criteria=)` on
    metrics the device computes (each firing every epoch; one of each; a plateau needs one
    injected learning rate).
    """
    validation: Validation | None = None
    watchers: list[Watcher] = []
    # An iteration handler may write a metric at the epoch's last step, which the device's
    # accumulators do not hold, or halt the epoch, which the device would already have
    # judged (a rate cut, a kept best, members stopped): with one, monitors stay on the host.
    handled = any(not r.observes for e in ITERATION_EVENTS for r in bus.by_event.get(e, ()))
    for r in bus.by_event.get(Event.EPOCH_COMPLETED, ()):
        if r.observes:
            continue
        if validation is None and not watchers:
            validation = _resident_validation(r)
            if validation is not None:
                continue
        watcher = _watcher(r, metrics, validation)
        if watcher is None or any(w.kind == watcher.kind for w in watchers):
            break  # a handler the device cannot run: later ones see what it wrote
        if handled:
            break
        if watcher.kind == "reduce_lr_on_plateau" and len(_rates(step_state)) != 1:
            break
        watchers.append(watcher)
    return DeviceWork(validation, tuple(watchers))


def _rates(step_state: Any) -> list[Any]:
    if not isinstance(step_state, dict) or "opt_state" not in step_state:
        return []
    return find_learning_rates(step_state["opt_state"])


# --------------------------------------------------------------------- device side
def device_value(spec: Any, acc: dict[str, Any]) -> Any:
    """`_metrics.read_metric` on the device, in the accumulators' dtype."""
    total, count = accumulated(acc)
    if spec.accumulate in ("running_sum", "last"):
        return total
    # XLA rewrites a division by a constant or a broadcast scalar (a validation set's
    # count is known when compiled) into a multiplication by its reciprocal, which is not
    # correctly rounded: 39/44 came out one ulp above the host's value, and a tie read as
    # an improvement. The barrier hides the divisor, so the division stays a division, as
    # the host's (`_metrics.read_metric`) is (a barrier on a constant alone is dropped).
    divisor = jnp.broadcast_to(jnp.where(count > 0, count, jnp.ones_like(count)), jnp.shape(total))
    total, divisor = lax.optimization_barrier((total, divisor))
    mean = total / divisor
    return jnp.where(count <= 0, jnp.nan, jnp.where(count < 1, jnp.zeros_like(mean), mean))


def epoch_end_fn(work: DeviceWork, segments: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`init(state, monitors) -> extra` and `end(state, acc, extra, s, inputs) -> (state,
    extra, per-epoch outputs)`: the epoch-end work, in registration order, for a dispatch
    of `segments` epoch pieces. The per-epoch outputs are `stop` (early stopping's
    verdict), `validation` (the evaluator's accumulators), `reduced` (a plateau reduced the
    rate) and `saved` (checkpoint-on-best improved); `extra["flush"]`, when present, ends
    the dispatch after this epoch (the kept best states are full).
    """
    validate = _validation_fn(work.validation)

    def init(state: Any, monitors: Any) -> dict[str, Any]:
        extra: dict[str, Any] = {"monitors": monitors, "best_s": jnp.int32(-1)}
        stopper = work.stopper
        if stopper is not None and stopper.handler.restore_best:
            extra["best_state"] = jax.tree.map(jnp.copy, state)
        if work.saver is not None:
            extra.update(kept_start(work.saver.handler.keep, segments, state))
        return extra

    def end(state: Any, acc: Any, extra: Any, s: Any, inputs: Any) -> tuple[Any, ...]:
        # A population validates all its members at once and hands each its accumulators.
        val_acc = (
            inputs["val_acc"] if "val_acc" in inputs else validate(state, inputs["validation"])
        )
        no = jnp.zeros((), jnp.bool_)
        flags = {"stop": no, "reduced": no, "saved": no}
        extra = {**extra, "monitors": dict(extra["monitors"])}
        for w in work.watchers:
            pool: Any = val_acc if w.validation else acc
            value = device_value(w.spec, pool[w.spec.name])
            # A halt by an earlier handler ends the bus's firing: later ones do not run.
            runs = ~flags["stop"]
            state, extra, flags = _watch(w, value, state, extra, flags, runs, s, inputs)
        return state, extra, {**flags, "validation": val_acc}

    return init, end


def _validation_fn(v: Validation | None) -> Callable[[Any, Any], Any]:
    """`(state, (data, order)) -> the evaluator's accumulators` (None without one)."""
    if v is None:
        return lambda state, inputs: None
    body = make_chunk_fn(make_carry_step(v.loop.program, v.loop.metrics, False), True, False)
    return validation_loop(v, body, lambda: init_tail(v.loop.metrics, False))


def validation_loop(
    v: Validation, body: Callable[..., Any], fresh_tail: Callable[[], Any]
) -> Callable[[Any, Any], Any]:
    """`(state, (data, order)) -> accumulators`: the evaluator's device loop `body` over
    the validation set from `fresh_tail()` (a solo run's or a population's), the whole
    batches as one chunk and a short last batch as a step of its own shape, as the
    evaluator runs them.
    """
    whole, short = v.batches, v.short

    def run(params: Any, tail: Any, vdata: Any, rows: Any, n: int) -> Any:
        chunk = jax.tree.map(lambda leaf: leaf[rows], vdata)
        return body(params, tail, chunk, jnp.int32(n))[1]

    def validate(state: Any, inputs: Any) -> Any:
        vdata, vorder = inputs
        last = vorder.shape[0] - 1
        params = {"params": state["params"]}
        tail = fresh_tail()
        if whole:
            rows = vorder[jnp.minimum(jnp.arange(max(whole, MIN_SLOTS)), last)]
            tail = run(params, tail, vdata, rows, whole)
        if short:
            rows = vorder[jnp.minimum(whole + jnp.arange(MIN_SLOTS), last)][:, :short]
            tail = run(params, tail, vdata, rows, 1)
        return tail["acc"]

    return validate


def _watch(
    w: Watcher, value: Any, state: Any, extra: Any, flags: Any, runs: Any, s: Any, inputs: Any
) -> tuple[Any, Any, Any]:
    """One watcher's epoch end (`runs`: it fires at all this epoch)."""
    record = extra["monitors"][w.kind]
    if w.kind == "early_stop":
        record, improved, stop = _stop_update(w.handler.monitor, record, value)
        flags = {**flags, "stop": stop}
        extra["best_s"] = jnp.where(improved, s, extra["best_s"])
        if "best_state" in extra:
            extra["best_state"] = lax.cond(
                improved,
                lambda kept=state: jax.tree.map(jnp.copy, kept),
                lambda kept=extra["best_state"]: kept,
            )
    elif w.kind == "checkpoint":
        record, improved, _ = _stop_update(w.handler.monitor, record, value)
        improved = improved & runs
        extra = keep_best(extra, state, improved)
        flags = {**flags, "saved": improved}
    else:
        record, state = _plateau_update(w.handler, record, value, state, inputs["rates"], runs)
        flags = {**flags, "reduced": record["reduced"]}
    extra["monitors"][w.kind] = (
        jax.tree.map(lambda new, old: jnp.where(runs, new, old), record, extra["monitors"][w.kind])
        if w.kind != "early_stop"
        else record
    )
    return state, extra, flags


def _stop_update(monitor: Any, record: Any, value: Any) -> tuple[Any, Any, Any]:
    """`Monitor.update` and the early-stop rule, on the device (verified on the host)."""
    improved = beats_best(monitor, value, record)
    wait = jnp.where(improved, 0, record["wait"] + 1)
    stop = ~jnp.isfinite(value) | ((wait > 0) & (wait >= monitor.patience))
    best = jnp.where(improved, value, record["best"])
    return (
        {**record, "best": best, "has_best": record["has_best"] | improved, "wait": wait},
        improved,
        stop,
    )


def _plateau_update(
    handler: Any, record: Any, value: Any, state: Any, rates: Any, runs: Any
) -> tuple[Any, Any]:
    """`ReduceLROnPlateau.decide` on the device (verified on the host); a reduction sets the
    next rate of the host's table (`rates[k]`, computed as `set_learning_rate` does).
    """
    rate_table, at_floor = rates
    cooling = record["cooldown"] > 0
    cooldown = jnp.where(cooling, record["cooldown"] - 1, record["cooldown"])
    wait = jnp.where(cooling, 0, record["wait"])
    improved = beats_best(handler.monitor, value, record)
    wait = jnp.where(improved, 0, wait + 1)
    quiet = improved | (cooldown > 0)
    wait = jnp.where(quiet & ~improved, 0, wait)
    due = ~quiet & (wait >= handler.monitor.patience)
    k = record["k"]
    wait = jnp.where(due & ~at_floor[k], 0, wait)  # at min_lr it goes on growing, as Keras's
    reduce = due & ~at_floor[k] & runs
    k = jnp.where(reduce, k + 1, k)
    cooldown = jnp.where(reduce, handler.cooldown, cooldown)
    state = lax.cond(reduce, lambda: _with_rate(state, rate_table[k]), lambda: state)
    record = {
        "best": jnp.where(improved, value, record["best"]),
        "has_best": record["has_best"] | improved,
        "wait": wait,
        "cooldown": cooldown,
        "k": k,
        "reduced": reduce,
    }
    return record, state


def _with_rate(state: Any, rate: Any) -> Any:
    opt_state = map_injected_rates(state["opt_state"], lambda old: rate.astype(old.dtype))
    return {**state, "opt_state": opt_state}


def monitor_start(work: DeviceWork, state: Any) -> dict[str, Any]:
    """The device monitors' records at a dispatch's start, from the host records."""
    out = {}
    for w in work.watchers:
        record = w.handler.monitor.record(state)
        best = record["best"]
        out[w.kind] = {
            "best": np.asarray(0.0 if best is None else best, accumulator_dtype()),
            "has_best": np.bool_(best is not None),
            "wait": np.int32(record["wait"]),
        }
        if w.kind == "reduce_lr_on_plateau":
            out[w.kind].update(
                cooldown=np.int32(record.get("cooldown", 0)), k=np.int32(0), reduced=np.bool_(False)
            )
    return out


def rate_table(work: DeviceWork, step_state: Any, epochs: int, reads: Any) -> tuple[Any, Any]:
    """The learning rates after 0, 1, ... `epochs` reductions, each computed from the last
    on the host exactly as the host handler computes it, and whether each is at `min_lr`
    (`reads`: the run's `HostReads`).
    """
    w = work.plateau
    if w is None:
        return np.zeros(1, np.float32), np.zeros(1, np.bool_)
    # Host read: the current learning rate, once per dispatch (a scalar).
    rate = np.asarray(reads.get(_rates(step_state)[0]))
    rates = [rate]
    for _ in range(epochs):
        rates.append(w.handler.next_rate(rates[-1]))
    floor = [w.handler.at_floor(r) for r in rates]
    return np.stack(rates), np.asarray(floor, np.bool_)
