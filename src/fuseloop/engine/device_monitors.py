"""Epoch-end work done on the device inside a multi-epoch dispatch (docs/design.md §8).

Two handlers have device twins: `validate` on device-resident validation data (the
evaluator's own device loop over the validation set, accumulating sums and counts) and
`early_stop` (the monitor's best, wait and stop, in float32). The host handlers stay the
reference: after the dispatch the host replays `early_stop` itself on each epoch's metrics
and checks that it decides what the device decided (a disagreement raises a FusionError,
never a silent difference), and `validate` is replayed by merging the device's validation
accumulators, read the way an evaluator run reads them.

A handler is recognised by its `on_device` attribute ("validate" or "early_stop"); the
engine imports no handler module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._events import ALWAYS, CONTINUE, Event, Registration
from .._fusion import FusionError, make_chunk_fn
from .._metrics import read_metric
from .._step import init_tail, make_carry_step

__all__ = ["DeviceWork", "plan_device_work"]

_PREFIX = "validation_"


@dataclass(frozen=True)
class Validation:
    registration: Registration
    loop: Any  # the evaluator Loop
    source: Any  # its resident ArraySource

    @property
    def batches(self) -> int:
        return self.source.n // self.source.batch_size


@dataclass(frozen=True)
class Stopper:
    registration: Registration
    handler: Any  # the host EarlyStopping
    spec: Any  # the MetricSpec it monitors
    validation: bool  # the metric is `validation_<spec.name>`


@dataclass(frozen=True)
class DeviceWork:
    """The epoch-end work of a run's dispatches; `key` identifies its programs."""

    validation: Validation | None
    stopper: Stopper | None

    @property
    def key(self) -> tuple[Any, ...]:
        return (
            self.validation.registration if self.validation else None,
            self.stopper.registration if self.stopper else None,
        )

    @property
    def registrations(self) -> set[Registration]:
        return {x.registration for x in (self.validation, self.stopper) if x is not None}


def _resident_validation(r: Registration) -> Validation | None:
    handler = r.handler
    source = getattr(handler, "data", None)
    if getattr(handler, "on_device", None) != "validate" or r.filter != ALWAYS:
        return None
    if not getattr(source, "resident", False) or source.n % source.batch_size:
        return None  # host-fed or with a short last batch: validated on the host
    return Validation(r, handler.loop, source)


def _stopper(r: Registration, metrics: Any, validation: Validation | None) -> Stopper | None:
    handler = r.handler
    if getattr(handler, "on_device", None) != "early_stop" or r.filter != ALWAYS:
        return None
    name = handler.monitor.monitor
    pools = [(False, metrics)]
    if validation is not None and name.startswith(_PREFIX):
        pools.append((True, validation.loop.metrics))
        name_in = {True: name[len(_PREFIX) :], False: name}
    else:
        name_in = {False: name}
    for is_validation, specs in pools:
        for spec in specs:
            if spec.name == name_in[is_validation]:
                return Stopper(r, handler, spec, is_validation)
    return None


def plan_device_work(bus: Any, metrics: Any) -> DeviceWork:
    """The `epoch_completed` handlers the device can run: a resident `validate`, and an
    `early_stop` after it on a metric the device computes (both firing every epoch).
    """
    validation = stopper = None
    for r in bus.by_event.get(Event.EPOCH_COMPLETED, ()):
        if r.observes:
            continue
        if validation is None and stopper is None:
            validation = _resident_validation(r)
            if validation is not None:
                continue
        if stopper is None:
            stopper = _stopper(r, metrics, validation)
            if stopper is not None:
                continue
        break  # a handler the device cannot run: later ones see what it wrote
    return DeviceWork(validation, stopper)


# --------------------------------------------------------------------- device side
def device_value(spec: Any, acc: dict[str, Any]) -> Any:
    """`_metrics.read_metric` in float32 on the device."""
    total = acc["sum"].astype(jnp.float32)
    if spec.accumulate in ("running_sum", "last"):
        return total
    count = acc["count"].astype(jnp.float32)
    mean = total / jnp.where(count > 0, count, jnp.float32(1))
    return jnp.where(count <= 0, jnp.nan, jnp.where(count < 1, jnp.float32(0), mean))


def epoch_end_fn(work: DeviceWork) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`(init(state, monitor0) -> extra, end(state, acc, extra, s) -> (extra, stop))`."""
    v, st = work.validation, work.stopper
    if v is not None:
        program = v.loop.program
        body = make_chunk_fn(make_carry_step(program, v.loop.metrics, False), True, False)
        slots = max(v.batches, 2)

    def validate(state: Any, vdata: Any, vorder: Any) -> Any:
        rows = vorder[jnp.minimum(jnp.arange(slots), vorder.shape[0] - 1)]
        chunk = jax.tree.map(lambda leaf: leaf[rows], vdata)
        tail = init_tail(v.loop.metrics, False)
        _, tail, _, _ = body({"params": state["params"]}, tail, chunk, jnp.int32(v.batches))
        return tail["acc"]

    def init(state: Any, monitor0: Any) -> dict[str, Any]:
        extra: dict[str, Any] = {"monitor": monitor0, "best_s": jnp.int32(-1)}
        if st is not None and st.handler.restore_best:
            extra["best_state"] = jax.tree.map(jnp.copy, state)
        return extra

    def end(state: Any, acc: Any, extra: Any, s: Any, inputs: Any) -> tuple[Any, Any, Any]:
        val_acc = validate(state, *inputs) if v is not None else None
        if st is None:
            return extra, jnp.zeros((), jnp.bool_), val_acc
        pool = val_acc if st.validation else acc
        value = device_value(st.spec, pool[st.spec.name])
        monitor, improved, stop = _monitor_update(st.handler.monitor, extra["monitor"], value)
        extra = {**extra, "monitor": monitor}
        extra["best_s"] = jnp.where(improved, s, extra["best_s"])
        if "best_state" in extra:
            extra["best_state"] = lax.cond(
                improved, lambda: jax.tree.map(jnp.copy, state), lambda: extra["best_state"]
            )
        return extra, stop, val_acc

    return init, end


def _monitor_update(monitor: Any, record: Any, value: Any) -> tuple[Any, Any, Any]:
    """`Monitor.update` and the early-stop rule, in float32 (verified on the host)."""
    best, has_best, wait = record["best"], record["has_best"], record["wait"]
    delta = jnp.float32(monitor.min_delta)
    beats = value < best - delta if monitor.mode == "min" else value > best + delta
    finite = jnp.isfinite(value)
    improved = finite & (~has_best | beats)
    wait = jnp.where(improved, 0, wait + 1)
    stop = ~finite | ((wait > 0) & (wait >= monitor.patience))
    record = {
        "best": jnp.where(improved, value, best),
        "has_best": has_best | improved,
        "wait": wait,
    }
    return record, improved, stop


def monitor_start(work: DeviceWork, state: Any) -> dict[str, Any]:
    """The device monitor's record at a dispatch's start, from the host record."""
    record = {"best": None, "wait": 0}
    if work.stopper is not None:
        record = work.stopper.handler.monitor.record(state)
    best = record["best"]
    return {
        "best": np.float32(0.0 if best is None else best),
        "has_best": np.bool_(best is not None),
        "wait": np.int32(record["wait"]),
    }


def validation_inputs(work: DeviceWork, programs: Any, placement: Any) -> tuple[Any, ...]:
    """The validation data on the device and its order (the evaluator's epoch 0)."""
    v = work.validation
    if v is None:
        return ()
    data = v.source.put(placement.replicated)
    order, _, _ = programs.epoch_order(v.source)(np.int32(0))  # cached by the source
    return data, order


# --------------------------------------------------------------------- host side
def replayed_handlers(
    work: DeviceWork, host: dict[str, Any], segment: int, live: bool
) -> dict[Registration, Registration]:
    """Substitutes for the device-run registrations when an epoch's `epoch_completed` is
    replayed from dispatch output `host` (segment `segment`).
    """
    out: dict[Registration, Registration] = {}
    v, st = work.validation, work.stopper
    if v is not None:
        acc = {k: _slot(a, segment) for k, a in host["validation"].items()}
        metrics = {
            _PREFIX + m.name: read_metric(m, acc[m.name])
            for m in v.loop.metrics
            if float(acc[m.name]["count"]) > 0
        }

        def merge(state: Any) -> tuple[str, Any]:
            return CONTINUE, state.replace(metrics={**state.metrics, **metrics})

        out[v.registration] = dataclasses.replace(v.registration, handler=merge)
    if st is not None:
        stopped = bool(host["stop"][segment])
        out[st.registration] = dataclasses.replace(
            st.registration, handler=_verified(st.handler, stopped, live)
        )
    return out


def _verified(handler: Any, device_stopped: bool, live: bool) -> Callable[[Any], Any]:
    def verified(state: Any) -> Any:
        status, state = handler(state if live else state.replace(step_state=None))
        if (status != CONTINUE) != device_stopped:
            raise FusionError(
                f"early_stop({handler.monitor.monitor!r}): the device monitor and the host "
                f"monitor disagree at epoch {state.epoch} (min_delta={handler.monitor.min_delta}"
                f" compared in float32 on the device); run with fuse=K at most the epoch's "
                f"length to monitor on the host"
            )
        return status, state

    return verified


def hand_best(work: DeviceWork, best_state: Any, best_epoch: int, value: float) -> None:
    """Gives `early_stop(restore_best=True)` the best step state the device kept."""
    handler = work.stopper.handler if work.stopper is not None else None
    if handler is not None and handler.restore_best and math.isfinite(value):
        handler._best = ((best_epoch, value), best_state)


def _slot(tree: Any, s: int) -> Any:
    return {k: v[s] for k, v in tree.items()} if isinstance(tree, dict) else tree[s]
