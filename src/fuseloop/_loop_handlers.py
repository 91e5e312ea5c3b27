"""The Loop builders that attach fuseloop's own handlers: log, early stopping, learning-rate
reduction, checkpoints and metric writers.

`Loop` inherits them from `HandlerBuilders`; each returns a new Loop, as every builder does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self, TextIO

from ._arg_types import is_int
from ._distributed import all_processes, runs_on_all_processes
from ._events import Event, closes_on_error, make_filter, normalize_event
from ._foreign_keywords import HANDLER_ADVICE, advise_foreign_keywords
from ._loop_args import check_monitored
from ._state import State
from ._types import EventLike, FilterLike, Mode

if TYPE_CHECKING:
    from ._events import Registration
    from ._step import Program
    from ._types import Handler

__all__ = ["HandlerBuilders"]


def _builds_own(builder: Callable[..., Any]) -> Callable[..., Any]:
    """Marks what `builder` attaches as fuseloop's own handlers (`Registration.own`)."""

    @functools.wraps(builder)
    def building(self: Any, *args: Any, **kwargs: Any) -> Any:
        return builder(self, *args, **kwargs)._own_since(self)

    return building


class HandlerBuilders:
    """The handler-attaching builders of `Loop` (a base class: `Loop` is the only user)."""

    if TYPE_CHECKING:  # what the builders use of Loop
        program: Program
        registrations: tuple[Registration, ...]

        def handle_event(
            self, event: EventLike, handler: Handler, filter: FilterLike = "always", name: str = ""
        ) -> Self: ...

        def observe(
            self,
            event: EventLike,
            fn: Callable[[State], None],
            filter: FilterLike = "always",
            name: str = "",
        ) -> Self: ...

        def _as_observers(self, before: int) -> Self: ...

        def _own_since(self, before: Self) -> Self: ...

        def _with(self, **changes: Any) -> Self: ...

    @advise_foreign_keywords({}, owner="Loop")
    def log(
        self,
        fn: Callable[[State], str],
        event: EventLike = "iteration_completed",
        filter: FilterLike = "always",
        stream: TextIO | None = None,
    ) -> Self:
        """Writes `fn(state)` to `stream` (stdout by default) when `event` fires.

        The text holds whatever `fn` returns; leave out timings and the output of a fused
        and an unfused run is byte for byte the same.

        Example:
            >>> state = loop.log(lambda s: f"epoch {s.epoch}\\n", event="epoch_completed").run(
            ...     batches, epochs=2)
            epoch 0
            epoch 1
        """
        from .handlers.log import Writer

        writer: Callable[[State], Any] = Writer(fn, stream)
        if runs_on_all_processes(fn):  # an observer writes on process 0, unless fn asks
            writer = all_processes(writer)
        return self.observe(event, writer, filter, name="log")

    @advise_foreign_keywords(HANDLER_ADVICE["early_stop"], owner="Loop")
    @_builds_own
    def early_stop(
        self,
        monitor: str,
        patience: int = 3,
        mode: Mode = "min",
        min_delta: float = 0.0,
        restore_best: bool = False,
    ) -> Self:
        """Halts after `patience` consecutive epochs without improvement (as Keras does).

        A non-finite monitored value halts at once. The best value and the wait count live
        in `state.handler_metadata`, so they survive a checkpoint and resume. With
        `restore_best=True` (Keras's `restore_best_weights`) the run ends with the step state
        of the best epoch, bitwise, however it ends. `mode` is "min" (a loss), "max" (an
        accuracy) or "auto" (read from the name's words; a name that says neither way is
        refused); "min" on an accuracy, precision, recall, r2, ... warns.

        Example:
            >>> stopping = loop.early_stop("loss", patience=1, min_delta=100.0)
            >>> state = stopping.run(batches, epochs=10)  # no epoch improves by 100
            >>> state.status, state.epoch
            ('halted', 1)
        """
        from .handlers.monitor import EarlyStopping

        key = self._monitor_key("early_stop", monitor)
        stopper = EarlyStopping(
            monitor, patience, mode, min_delta, key=key, restore_best=restore_best
        )
        # With restore_best, its start and end handlers come along (`fuseloop_companions`).
        return self.handle_event("epoch_completed", stopper, name="early_stop")

    @advise_foreign_keywords(HANDLER_ADVICE["reduce_lr_on_plateau"], owner="Loop")
    @_builds_own
    def reduce_lr_on_plateau(
        self,
        monitor: str,
        factor: float = 0.1,
        patience: int = 3,
        mode: Mode = "min",
        min_delta: float = 0.0,
        min_lr: float = 0.0,
        cooldown: int = 0,
    ) -> Self:
        """Multiplies the learning rate by `factor` after `patience` epochs on a plateau.

        Needs an optimizer built with `optax.inject_hyperparams` (the named optimizers
        are); any other raises a ValueError here. The new rate applies from the next step.

        Example:
            >>> plain = fl.trainer(model, "sparse_categorical_cross_entropy", "sgd")
            >>> reducing = plain.reduce_lr_on_plateau("loss", factor=0.5, patience=1,
            ...                                       min_delta=100.0)
            >>> state = reducing.run(batches, epochs=3)
            >>> [round(float(h["learning_rate"]), 4) for h in state.history.values()]
            [0.01, 0.01, 0.005]
        """
        from .handlers.monitor import ReduceLROnPlateau

        key = self._monitor_key("reduce_lr_on_plateau", monitor)
        handler = ReduceLROnPlateau(
            monitor, factor, patience, mode, min_delta, min_lr, cooldown, key=key
        )
        # A trainer's optimizer is checked by handle_event; any other loop is refused here.
        if self.program.kind != "trainer":
            handler.check_optimizer(self.program)
        return self.handle_event("epoch_completed", handler, name="reduce_lr_on_plateau")

    @advise_foreign_keywords(HANDLER_ADVICE["checkpoint"], owner="Loop")
    @_builds_own
    def checkpoint(
        self,
        path: str | os.PathLike[str],
        event: EventLike = "epoch_completed",
        filter: FilterLike = "always",
        criteria: str | None = None,
        mode: Mode = "min",
        keep: int | None = None,
        asynchronous: bool = False,
    ) -> Self:
        """Saves the whole State under `path` (one atomic subdirectory per save).

        Attach it last, so each save holds what the other handlers did this epoch.
        `fl.load_state(path)` loads the latest complete one. Without `criteria`, a run
        that halts (early stopping, SIGINT/SIGTERM) also saves its final State.

        Args:
            path: The checkpoint directory.
            event: When to save (default: at the end of each epoch).
            filter: Which firings save, e.g. `{"every": 5}`.
            criteria: Save only when this metric improves (checkpoint-on-best). A
                population saves each member's own best alone under `path/member_<i>/`.
            mode: "min", "max" or "auto" (read from the name) for `criteria`.
            keep: Keep only the newest `keep` checkpoints (None: all).
            asynchronous: Write in the background so training does not wait on the disk;
                the run waits for the last write before it returns.

        Example:
            >>> import os, tempfile
            >>> directory = tempfile.mkdtemp()
            >>> state = loop.checkpoint(directory, keep=2).run(batches, epochs=3)
            >>> len(fl.handlers.checkpoint.list_checkpoints(directory))
            2
        """
        from .handlers.checkpoint import Checkpointer, refuse_shared_directory

        normalize_event(event, hint=_keras_checkpoint)
        fires = make_filter(filter)
        key = self._monitor_key("checkpoint", criteria, fires) if criteria is not None else ""
        saver = Checkpointer(path, criteria, mode, keep, key=key, asynchronous=asynchronous)
        refuse_shared_directory(self.registrations, saver)
        # A Loop may run again: each run starts the saver afresh (`Checkpointer.begin`).
        loop = self.observe("started", all_processes(saver.begin), name="checkpoint:start")
        loop = loop.handle_event(event, saver, filter, name="checkpoint")
        if criteria is None and normalize_event(event) != Event.HALTED:
            # A halted run (early stop, a signal) also saves its final State: the epoch's
            # own, before early_stop(restore_best=True) hands back the best one.
            loop = _before_restores(loop.handle_event("halted", saver.on_halted, name="checkpoint"))
        if asynchronous:  # the run returns only when every write is complete (or raises)
            finish = closes_on_error(saver.finish)
            loop = loop.handle_event("completed", finish, name="checkpoint:finish")
            loop = loop.handle_event("halted", finish, name="checkpoint:finish")
        return loop

    @advise_foreign_keywords(HANDLER_ADVICE["csv_log"], owner="Loop")
    @_builds_own
    def csv_log(
        self,
        path: str | os.PathLike[str],
        event: EventLike = "epoch_completed",
        filter: FilterLike = "always",
    ) -> Self:
        """Writes the metrics to a CSV file, one row (epoch, iteration, step, metrics...)
        per firing.

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
            >>> state = loop.csv_log(path).run(batches, epochs=2)
            >>> open(path).readline().strip()
            'epoch,iteration,step,loss'
        """
        from .handlers.writers import CSVWriter, attach_writer

        before = len(self.registrations)
        built = attach_writer(self, CSVWriter(path, event), event, filter, "csv_log")
        return built._as_observers(before)

    @advise_foreign_keywords({}, owner="Loop")
    @_builds_own
    def tensorboard(
        self,
        logdir: str | os.PathLike[str],
        event: EventLike = "epoch_completed",
        filter: FilterLike = "always",
        prefix: str | None = None,
    ) -> Self:
        """Writes the metrics as TensorBoard scalars (needs tensorboardX).

        Args:
            logdir: The directory the event files go to.
            event: When to write a row of scalars.
            filter: Which firings write, e.g. `{"every": 10}`.
            prefix: Put before each metric's name to make its tag, as it is: by default
                "epoch/" for epoch events, "iteration/" for iteration events; end it with
                a "/" for a group of its own (`prefix="train/"` tags "train/loss").

        Example:
            >>> import os, tempfile
            >>> logdir = tempfile.mkdtemp()
            >>> state = loop.tensorboard(logdir, event="iteration_completed",
            ...                          filter={"every": 2}).run(batches, epochs=1)
            >>> [name.startswith("events.out.tfevents") for name in os.listdir(logdir)]
            [True]
        """
        from .handlers.writers import TensorBoardWriter, attach_writer

        before = len(self.registrations)
        built = attach_writer(
            self, TensorBoardWriter(logdir, event, prefix), event, filter, "tensorboard"
        )
        return built._as_observers(before)

    def _monitor_key(self, who: str, monitor: str, fires: Any = None) -> str:
        """The metadata key of a handler monitoring `monitor`, once it is known to be there
        at every epoch's end its filter `fires` passes (`check_monitored`)."""
        check_monitored(self.registrations, monitor, who, fires)
        return self._metadata_key(f"{who}:{monitor}")

    def _metadata_key(self, base: str) -> str:
        """A `handler_metadata` key no attached handler uses yet (stable across runs)."""
        used = {
            getattr(getattr(r.handler, "monitor", None), "key", None) for r in self.registrations
        }
        key, n = base, 1
        while key in used:
            n += 1
            key = f"{base}#{n}"
        return key


def _before_restores(loop: Any) -> Any:
    """`loop` with its last registration moved before early_stop's restore on the same
    event, so what it saves is the step state the run reached, not the best one the
    restore hands back."""
    registrations = list(loop.registrations)
    last = registrations.pop()
    at = next(
        (
            i
            for i, r in enumerate(registrations)
            if r.name == "early_stop:restore" and r.event == last.event
        ),
        len(registrations),
    )
    registrations.insert(at, last)
    return loop._with(registrations=tuple(registrations))


def _keras_checkpoint(value: Any) -> str:
    """What checkpoint's event slot held where Keras's ModelCheckpoint(filepath, monitor)
    or its save_freq went."""
    if isinstance(value, str):
        return "; a metric to save the best by is criteria=..."
    if is_int(value):
        return f"; a save every {value} epochs is filter={{'every': {value}}}"
    return ""
