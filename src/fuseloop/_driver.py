"""The host-side driver of `Loop.run`: epochs, events, halting, host boundaries.

This is the one module that reads device values on the host; every such read goes through
`_HostReads` and is named in a comment at its call site.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._data import as_source
from ._events import CONTINUE, HALT_EPOCH, HALT_LOOP, Event
from ._execute import Executor
from ._metrics import read_metric
from ._replay import EventBus
from ._state import State, new_stats
from ._signals import SignalGuard
from ._start import initial_step_state

__all__ = ["run_loop"]

_RAN_OUT = "ran_out"  # an epoch found no data left: the run ends, completed


class _HostReads:
    """The only place device values are pulled to the host; counts `host_syncs`."""

    def __init__(self, stats: dict[str, Any], metrics: tuple[Any, ...]):
        self.stats, self.metrics = stats, metrics

    def get(self, tree: Any) -> Any:
        self.stats["host_syncs"] += 1
        return jax.device_get(tree)

    def metrics_of(self, acc_host: dict[str, Any]) -> dict[str, float]:
        """Host floats from accumulators already on the host (no sync here)."""
        return {
            m.name: read_metric(m, acc_host[m.name])
            for m in self.metrics
            if float(acc_host[m.name]["count"]) > 0
        }


def _check_count(value: Any, argument: str, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{argument}={value!r} must be a positive int")


class Run:
    """One call of `Loop.run`."""

    def __init__(self, loop: Any, data: Any, init_state: Any, *, epochs: int,
                 iterations: int | None, fuse: Any, jit: bool, progress: bool,
                 mesh: Any, max_in_flight: int, prefetch: int = 2):
        _check_count(epochs, "epochs", allow_none=False)
        _check_count(iterations, "iterations", allow_none=True)
        _check_count(max_in_flight, "max_in_flight", allow_none=False)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r} must be an int >= 0 (chunks pulled ahead "
                             f"in a background thread; 0 pulls the next chunk in the caller)")
        if not isinstance(jit, bool):
            raise ValueError(f"jit={jit!r} must be True or False")
        if not isinstance(progress, bool):
            raise ValueError(f"progress={progress!r} must be True or False")
        self.loop, self.epochs, self.iterations = loop, int(epochs), iterations
        self.stats = new_stats()
        self.source = as_source(data)
        self.reads = _HostReads(self.stats, loop.metrics)
        self.executor = Executor(loop, fuse=fuse, jit=jit, mesh=mesh, stats=self.stats,
                                 max_in_flight=max_in_flight, reads=self.reads,
                                 prefetch=prefetch)
        self.bus = EventBus(loop.registrations, progress=progress, reads=self.reads)
        self.init_state = init_state

    # ----------------------------------------------------------------- state setup
    def _resume(self) -> tuple[State, Any, int]:
        """The starting State, the user's initial step state, and the first epoch."""
        given = self.init_state
        state = State(max_epoch=self.epochs, max_iteration=self.iterations, stats=self.stats)
        if not isinstance(given, State):
            return state, given, 0
        if self.loop.program.kind == "evaluator":  # a State only supplies params
            return state, given.params, 0
        start = max(given.history) + 1 if given.history else 0
        self.bus.restore_counts(given.event_counts)
        state = state.replace(history={k: dict(v) for k, v in given.history.items()},
                              handler_metadata=dict(given.handler_metadata),
                              times=dict(given.times), epoch=start)
        return state, given.step_state, start

    def _first_batch(self) -> Any:
        self.first_iterator = self.source.epoch_iterator(self.start_epoch)
        first = self.source.pull(self.first_iterator, 1)
        if not first:
            raise ValueError(
                "data is empty: the first epoch yielded no batch. Pass at least one (x, y) "
                "batch (check batch_size against the dataset size and drop_remainder)"
            )
        self.executor.checker.first(first[0])
        return first[0]

    # ----------------------------------------------------------------- the run
    def run(self) -> State:
        state, user_state, self.start_epoch = self._resume()
        try:
            first = self._first_batch()
            step_state = initial_step_state(self.loop, user_state, first,
                                            resuming=isinstance(self.init_state, State))
            self.executor.checker.variables(step_state)
            self.executor.start(step_state, first, self.source, self.start_epoch,
                                self.iterations)
            with SignalGuard() as signals:
                state = self._epochs(state, signals)
        finally:
            self.source.close()
            self.bus.close()
        return state.replace(step_state=self.executor.state, stats=self.stats,
                             event_counts=self.bus.counts(), iteration=state.iteration)

    def _epochs(self, state: State, signals: SignalGuard) -> State:
        compiles_before = self.executor.traces()
        state = state.replace(step_state=self.executor.state)
        status, state = self.bus.fire(Event.STARTED, state)
        self.executor.adopt(state.step_state)
        halted = status == HALT_LOOP
        epoch = self.start_epoch
        while not halted and epoch < self.epochs:
            state, status = self._epoch(state, epoch, signals)
            if status == _RAN_OUT:
                break
            halted = status == HALT_LOOP or signals.requested
            epoch += 1
        self.stats["compiles"] = self.executor.traces() - compiles_before
        final = Event.HALTED if halted else Event.COMPLETED
        state = state.replace(status="halted" if halted else "completed",
                              step_state=self.executor.state, event_counts=self.bus.counts())
        _, state = self.bus.fire(final, state)
        return state.replace(status="halted" if halted else "completed")

    def _epoch(self, state: State, epoch: int, signals: SignalGuard) -> tuple[State, str]:
        began = time.perf_counter()
        self.bus.new_epoch()
        self.executor.reset_metrics()
        state = state.replace(epoch=epoch, iteration=0, metrics={}, status="running",
                              step_state=self.executor.state)
        status, state = self.bus.fire(Event.EPOCH_STARTED, state)
        self.executor.adopt(state.step_state)
        if status == CONTINUE:
            iterator = (self.first_iterator if epoch == self.start_epoch
                        else self.source.epoch_iterator(epoch))
            status, state = self.executor.run_epoch(state, iterator, self.source,
                                                    self.iterations, self.bus, signals)
            if status == CONTINUE and self._ran_out(epoch):
                return state, _RAN_OUT
        if status == HALT_LOOP and state.handler_metadata.get("_nonfinite_at") is not None:
            self._warn_nonfinite(state)
        if signals.requested:
            status = HALT_LOOP
        # Host boundary: the end of the epoch reads the final metric accumulators.
        metrics = dict(state.metrics)
        metrics.update(self.executor.final_metrics())
        self.stats["epoch_time"][epoch] = time.perf_counter() - began
        state = state.replace(metrics=metrics, step_state=self.executor.state,
                              times={**state.times, epoch: time.perf_counter() - began})
        if status == HALT_LOOP:
            # Halted mid-epoch (a handler, a non-finite loss, a signal): the epoch is not
            # complete, so history does not record it and a resumed run redoes it.
            return state, status
        state = state.replace(history={**state.history, epoch: dict(metrics)})
        event = Event.EPOCH_HALTED if status == HALT_EPOCH else Event.EPOCH_COMPLETED
        status, state = self.bus.fire(event, state, mirror_history=True)
        self.executor.adopt(state.step_state)
        return state, status

    def _ran_out(self, epoch: int) -> bool:
        """A one-shot iterator that had nothing left for this epoch ends the run (as Keras
        does when its input runs out), with a warning naming the epoch."""
        if self.executor.resident is not None or self.source.epoch_pulled > 0:
            return False
        warnings.warn(
            f"data ran out at the start of epoch {epoch}: the run ends after {epoch} epochs "
            f"instead of {self.epochs}. A one-shot iterator is consumed across epochs; pass "
            f"a re-iterable or a callable returning a fresh iterator, or lower epochs",
            RuntimeWarning,
            stacklevel=5,
        )
        return True

    @staticmethod
    def _warn_nonfinite(state: State) -> None:
        where = state.handler_metadata["_nonfinite_at"]
        warnings.warn(
            f"terminate_on_nan: the loss became non-finite at epoch {where['epoch']}, "
            f"iteration {where['iteration']}; that step was not applied and the loop halted "
            f"with the parameters from before it",
            RuntimeWarning,
            stacklevel=4,
        )


def run_loop(loop: Any, data: Any, init_state: Any = None, **options: Any) -> State:
    """Runs `loop` over `data` (see `Loop.run`)."""
    return Run(loop, data, init_state, **options).run()
