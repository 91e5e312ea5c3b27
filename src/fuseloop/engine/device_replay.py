"""The host side of a multi-epoch dispatch's device-run handlers (docs/design.md §9).

When an epoch that ended inside a dispatch is replayed, each device-run registration is
replaced for that firing by a substitute: `validate` merges the device's validation
metrics; `early_stop` and `reduce_lr_on_plateau` run the host handler (the reference) and
check that it decides what the device decided; `checkpoint(criteria=...)` writes the state
the device kept (`device_checkpoint.BestSaves`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from .._events import CONTINUE, Registration
from .._fusion import FusionError
from .._metrics import VALIDATION_PREFIX, read_metric
from .device_checkpoint import BestSaves
from .device_monitors import DeviceWork
from .packing import segment_of

__all__ = ["replayed_handlers", "hand_best"]


class _Substitutes(dict[Any, Any]):
    """Substitutes looked up by the registration's identity: the bus asks for every
    registration of every replayed epoch, and hashing a Registration (a frozen dataclass
    with a handler and a filter inside) costs more than the rest of the lookup.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(id(key), value)

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(id(key))

    def __contains__(self, key: Any) -> bool:
        return super().__contains__(id(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(id(key), default)


def replayed_handlers(
    work: DeviceWork,
    host: dict[str, Any],
    segment: int,
    live: bool,
    rate: Any,
    saves: BestSaves | None = None,
) -> dict[Registration, Registration]:
    """Substitutes for the device-run registrations when an epoch's `epoch_completed` is
    replayed from dispatch output `host` (segment `segment`); `rate` is the learning rate
    the epoch ended with; `saves` writes the dispatch's kept best states.
    """
    out: dict[Registration, Registration] = _Substitutes()
    v = work.validation
    if v is not None:
        acc = {k: segment_of(a, segment) for k, a in host["validation"].items()}
        metrics = {
            VALIDATION_PREFIX + m.name: read_metric(m, acc[m.name])
            for m in v.loop.metrics
            if float(acc[m.name]["count"]) > 0
        }

        def merge(state: Any) -> tuple[str, Any]:
            return CONTINUE, state.replace(metrics={**state.metrics, **metrics})

        out[v.registration] = dataclasses.replace(v.registration, handler=merge)
    for w in work.watchers:
        if w.kind == "early_stop":
            handler = _verified_stop(w.handler, bool(host["stop"][segment]), live)
        elif w.kind == "checkpoint":
            assert saves is not None  # made by the dispatch when a saver runs on the device
            handler = saves.replayed(bool(host["saved"][segment]))
        else:
            reduced = bool(host["reduced"][segment])
            handler = _verified_plateau(w.handler, reduced, live, rate)
        out[w.registration] = dataclasses.replace(w.registration, handler=handler)
    return out


def _disagree(name: str, monitor: Any, epoch: int) -> FusionError:
    return FusionError(
        f"{name}({monitor.monitor!r}): the device monitor and the host monitor disagree at "
        f"epoch {epoch} (min_delta={monitor.min_delta}, values compared on the device in "
        f"the metrics' dtype); "
        f"run with fuse=K at most the epoch's length to monitor on the host"
    )


def _verified_stop(handler: Any, device_stopped: bool, live: bool) -> Callable[[Any], Any]:
    def verified(state: Any) -> Any:
        status, state = handler(state if live else state.replace(step_state=None))
        if (status != CONTINUE) != device_stopped:
            raise _disagree("early_stop", handler.monitor, state.epoch)
        return status, state

    return verified


def _verified_plateau(
    handler: Any, device_reduced: bool, live: bool, rate: Any
) -> Callable[[Any], Any]:
    """The host arithmetic on the epoch's metrics; the rate change itself was made on the
    device (its step state is the carry's when live).
    """

    def verified(state: Any) -> Any:
        value = handler.monitor.value(state)
        record = handler.monitor.record(state)
        record, reduce = handler.decide(record, value, state.epoch, lambda: rate)
        if reduce != device_reduced:
            raise _disagree("reduce_lr_on_plateau", handler.monitor, state.epoch)
        return CONTINUE, handler.monitor.store(state, record)

    return verified


def hand_best(work: DeviceWork, best_state: Any, best_epoch: int, value: float) -> None:
    """Gives `early_stop(restore_best=True)` the best step state the device kept."""
    handler = work.stopper.handler if work.stopper is not None else None
    if handler is not None and handler.restore_best and math.isfinite(value):
        handler._best = ((best_epoch, value), best_state)
