"""`Loop`: the immutable builder, and the `trainer`/`evaluator`/`loop` factories."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from ._events import Event, Registration, make_filter, normalize_event
from ._metrics import MetricSpec, resolve_metric
from ._state import State
from ._step import (
    Program,
    custom_program,
    default_metrics,
    evaluator_program,
    trainer_program,
)
from ._types import Accumulate, EventLike, FilterLike, Fuse, Handler, Mode
from .engine import run_loop
from .engine.programs import ProgramCache
from .engine.run import check_run_options

__all__ = ["Loop", "trainer", "evaluator", "loop"]


@dataclass(frozen=True)
class Loop:
    """A training, evaluation or custom loop. Every builder returns a new Loop.

    Example:
        >>> import fuseloop as fl, optax
        >>> loop = fl.trainer(fl.models.mlp([8, 2]), "sparse_categorical_cross_entropy",
        ...                   optax.sgd(0.1)).metric("accuracy")
    """

    program: Program
    metrics: tuple[MetricSpec, ...] = ()
    registrations: tuple[Registration, ...] = ()
    guard_nonfinite: bool = False
    _programs: ProgramCache = field(default_factory=ProgramCache, compare=False, repr=False)

    def _with(self, **changes: Any) -> Loop:
        # Compiled programs depend on the step, the metrics and the guard, not on handlers:
        # a loop that only gains handlers shares its parent's program cache.
        shares_programs = set(changes) <= {"registrations"}
        programs = self._programs if shares_programs else ProgramCache()
        return dataclasses.replace(self, _programs=programs, **changes)

    # ----------------------------------------------------------------- builders
    def metric(
        self, metric: Any, name: str | None = None, accumulate: Accumulate = "running_average"
    ) -> Loop:
        """Adds a metric, computed on the device each step and accumulated there.

        Args:
            metric: A name ("accuracy", "precision", "recall", "mean_absolute_error",
                "mean_squared_error") or `callable(y_true, y_pred) -> scalar`.
            name: The key in `state.metrics` (default: the metric's name).
            accumulate: "running_average" (for built-in metrics and the loss, the mean over
                the epoch's examples; for a callable, the mean of its per-batch values) or
                "running_sum".

        Example:
            >>> state = loop.metric("accuracy").run(batches, epochs=1)
            >>> sorted(state.metrics)
            ['accuracy', 'loss']
        """
        if (
            self.program.kind == "custom"
            and isinstance(metric, str)
            and (metric not in _known_metrics())
        ):
            spec = MetricSpec(name or metric, None, _check_accumulate(accumulate), source=metric)
        else:
            spec = resolve_metric(metric, name, accumulate)
        if any(m.name == spec.name for m in self.metrics):
            raise ValueError(f"metric name {spec.name!r} is already used; pass name=...")
        return self._with(metrics=self.metrics + (spec,))

    def handle_event(
        self, event: EventLike, handler: Handler, filter: FilterLike = "always", name: str = ""
    ) -> Loop:
        """Attaches `handler(state)` to `event`, fired when `filter` passes.

        Example:
            >>> state = loop.handle_event("epoch_completed", lambda s: print(s.epoch)).run(
            ...     batches, epochs=2)
            0
            1
        """
        event = normalize_event(event)
        if not callable(handler):
            raise ValueError(f"handler={handler!r} must be callable(state)")
        registration = Registration(event, handler, make_filter(filter), name)
        return self._with(registrations=self.registrations + (registration,))

    def observe(
        self, event: Any, fn: Callable[[State], None], filter: Any = "always", name: str = ""
    ) -> Loop:
        """Attaches `fn(state)` to `event` as a handler that only observes.

        `fn` must return None (anything else raises a ValueError): it cannot halt or change
        the State, so it never ends a multi-epoch dispatch (`run(fuse="run")`); its events
        are replayed after the dispatch, in the unfused order, with each epoch's own
        metrics. Inside a replayed epoch `state.step_state` is None, as in the iteration
        events of a fused loop (docs/design.md §9).

        Example:
            >>> import fuseloop as fl, numpy as np, optax
            >>> seen = []
            >>> loop = fl.trainer(fl.models.mlp([4, 2]), "sparse_categorical_cross_entropy",
            ...                   optax.sgd(0.1)).observe("epoch_completed",
            ...                                           lambda s: seen.append(s.epoch))
            >>> data = fl.data.arrays(np.ones((8, 3), np.float32), np.zeros(8, np.int32),
            ...                       batch_size=4, device=True)
            >>> loop.run(data, epochs=3, fuse="run").stats["dispatches"], seen
            (1, [0, 1, 2])
        """
        event = normalize_event(event)
        if not callable(fn):
            raise ValueError(f"fn={fn!r} must be callable(state) -> None")
        registration = Registration(event, fn, make_filter(filter), name, observes=True)
        return self._with(registrations=self.registrations + (registration,))

    def _as_observers(self, before: int) -> Loop:
        """This loop with the registrations after the first `before` marked as observers
        (the writers attached by csv_log and tensorboard only look).
        """
        marked = self.registrations[:before] + tuple(
            dataclasses.replace(r, observes=True) for r in self.registrations[before:]
        )
        return self._with(registrations=marked)

    def log(
        self,
        fn: Callable[[State], str],
        event: EventLike = "iteration_completed",
        filter: FilterLike = "always",
        stream: TextIO | None = None,
    ) -> Loop:
        """Writes `fn(state)` to `stream` (stdout by default) when `event` fires.

        The text holds whatever `fn` returns; leave out timings and the output of a fused
        and an unfused run is byte for byte the same.

        Example:
            >>> state = loop.log(lambda s: f"epoch {s.epoch}\\n", event="epoch_completed").run(
            ...     batches, epochs=2)
            epoch 0
            epoch 1
        """
        from ._distributed import main_process_only, runs_on_all_processes
        from .handlers.log import Writer

        writer: Callable[[State], Any] = Writer(fn, stream)
        if not runs_on_all_processes(fn):  # process 0 writes, unless fn asks for all
            writer = main_process_only(writer)
        return self.observe(event, writer, filter, name="log")

    def validate(
        self,
        model: Any,
        data: Any,
        event: EventLike = "epoch_completed",
        filter: FilterLike = "always",
        fuse: Fuse = False,
    ) -> Loop:
        """Evaluates on `data` and adds `validation_<name>` for the loss and each metric.

        Attach it after `metric(...)` calls (it evaluates the metrics the loop has then) and
        before handlers that monitor `validation_*`. The evaluation loop is built once here,
        so it compiles once; it reads the params and never changes them.

        Args:
            model: The model to evaluate (usually the trainer's).
            data: Re-iterable validation batches (list, callable, `fl.data.arrays`).
            event: When to validate (default: at the end of each epoch).
            filter: Which firings validate, e.g. `{"every": 5}`.
            fuse: The validation run's `fuse`: False, True or a chunk size.

        Example:
            >>> state = loop.metric("accuracy").validate(model, val_batches).run(batches)
            >>> sorted(state.metrics)
            ['accuracy', 'loss', 'validation_accuracy', 'validation_loss']
        """
        from .handlers.validate import Validator, check_validation, evaluable_metrics

        loss = self.program.loss
        specs = evaluable_metrics(self.metrics, loss is not None)
        check_validation(model, data, fuse, specs)
        evaluation = Loop(evaluator_program(model, loss), metrics=specs)
        return self.handle_event(event, Validator(evaluation, data, fuse), filter, name="validate")

    def early_stop(
        self,
        monitor: str,
        patience: int = 3,
        mode: Mode = "min",
        min_delta: float = 0.0,
        restore_best: bool = False,
    ) -> Loop:
        """Halts after `patience` consecutive epochs without improvement (as Keras does).

        A non-finite monitored value halts at once. The best value and the wait count live
        in `state.handler_metadata`, so they survive a checkpoint and resume. With
        `restore_best=True` (Keras's `restore_best_weights`) the run ends with the step state
        of the best epoch, bitwise, however it ends.

        Example:
            >>> stopping = loop.early_stop("loss", patience=1, min_delta=100.0)
            >>> state = stopping.run(batches, epochs=10)  # no epoch improves by 100
            >>> state.status, state.epoch
            ('halted', 1)
        """
        from .handlers.monitor import EarlyStopping

        key = self._metadata_key(f"early_stop:{monitor}")
        stopper = EarlyStopping(
            monitor, patience, mode, min_delta, key=key, restore_best=restore_best
        )
        built = self.handle_event("epoch_completed", stopper, name="early_stop")
        if restore_best:  # however the run ends, it ends on the best epoch's step state
            built = built.handle_event("completed", stopper.on_end, name="early_stop:restore")
            built = built.handle_event("halted", stopper.on_end, name="early_stop:restore")
        return built

    def reduce_lr_on_plateau(
        self,
        monitor: str,
        factor: float = 0.1,
        patience: int = 3,
        mode: Mode = "min",
        min_delta: float = 0.0,
        min_lr: float = 0.0,
        cooldown: int = 0,
    ) -> Loop:
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

        key = self._metadata_key(f"reduce_lr_on_plateau:{monitor}")
        handler = ReduceLROnPlateau(
            monitor, factor, patience, mode, min_delta, min_lr, cooldown, key=key
        )
        handler.check_optimizer(self.program)
        return self.handle_event("epoch_completed", handler, name="reduce_lr_on_plateau")

    def checkpoint(
        self,
        path: str,
        event: EventLike = "epoch_completed",
        filter: FilterLike = "always",
        criteria: str | None = None,
        mode: Mode = "min",
        keep: int | None = None,
        asynchronous: bool = False,
    ) -> Loop:
        """Saves the whole State under `path` (one atomic subdirectory per save).

        Attach it last, so each save holds what the other handlers did this epoch.
        `fl.load_state(path)` loads the latest complete one. Without `criteria`, a run
        that halts (early stopping, SIGINT/SIGTERM) also saves its final State.

        Args:
            path: The checkpoint directory.
            event: When to save (default: at the end of each epoch).
            filter: Which firings save, e.g. `{"every": 5}`.
            criteria: Save only when this metric improves (checkpoint-on-best).
            mode: "min" or "max" for `criteria`.
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
        from .handlers.checkpoint import Checkpointer

        key = self._metadata_key(f"checkpoint:{criteria}") if criteria is not None else ""
        saver = Checkpointer(path, criteria, mode, keep, key=key, asynchronous=asynchronous)
        loop = self.handle_event(event, saver, filter, name="checkpoint")
        if criteria is None and normalize_event(event) != Event.HALTED:
            # A halted run (early stop, a signal) also saves its final State.
            loop = loop.handle_event("halted", saver.on_halted, name="checkpoint")
        if asynchronous:  # the run returns only when every write is complete
            loop = loop.handle_event("completed", saver.finish, name="checkpoint:finish")
            loop = loop.handle_event("halted", saver.finish, name="checkpoint:finish")
        return loop

    def csv_log(
        self, path: str, event: EventLike = "epoch_completed", filter: FilterLike = "always"
    ) -> Loop:
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
        built: Loop = attach_writer(self, CSVWriter(path, event), event, filter, "csv_log")
        return built._as_observers(before)

    def tensorboard(
        self,
        logdir: str,
        event: EventLike = "epoch_completed",
        filter: FilterLike = "always",
        prefix: str | None = None,
    ) -> Loop:
        """Writes the metrics as TensorBoard scalars (needs tensorboardX).

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
        built: Loop = attach_writer(
            self, TensorBoardWriter(logdir, event, prefix), event, filter, "tensorboard"
        )
        return built._as_observers(before)

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

    def terminate_on_nan(self) -> Loop:
        """Halts at the first non-finite loss, checked on the device (even inside a chunk).

        The bad step is not applied: params are exactly those from before it.

        Example:
            >>> bad = batches[:2] + [(batches[2][0] * np.nan, batches[2][1])] + batches[3:]
            >>> import warnings
            >>> with warnings.catch_warnings(record=True) as caught:
            ...     state = loop.terminate_on_nan().run(bad, fuse=4)
            >>> print(caught[0].message)
            terminate_on_nan: the loss became non-finite at epoch 0, iteration 2; ...
            >>> state.status, state.iteration  # halted at the third batch
            ('halted', 2)
        """
        return self._with(guard_nonfinite=True)

    # ----------------------------------------------------------------- running
    def run(
        self,
        data: Any,
        init_state: Any = None,
        *,
        epochs: int = 1,
        iterations: int | None = None,
        fuse: Fuse = False,
        jit: bool = True,
        progress: bool = False,
        mesh: Any = None,
        max_in_flight: int = 64,
        prefetch: int = 2,
        population: Any = None,
    ) -> State:
        """Runs the loop.

        Args:
            data: A list of `(x, y)` batches, a re-iterable, a callable returning an
                iterator, a one-shot iterator, or `fl.data.arrays(...)`.
            init_state: None (initialize from the first batch), initial variables, or a
                State to resume from.
            epochs: Total number of epochs (a resumed run continues up to this many).
            iterations: Bound on iterations per epoch.
            fuse: False; True (chunks of 32); a positive int chunk size; "auto"; or "run".
                On device-resident data (`fl.data.arrays(..., device=True)`), "run" and a
                chunk size larger than the epoch run many epochs per dispatch, ending a
                dispatch only where a handler that may halt or change the State fires
                (`state.stats["dispatch_splits"]` says where and why); on host-fed data
                chunks stay within an epoch ("run" is one chunk per epoch).
            jit: False runs op by op for debugging (unfused only).
            progress: Show a tqdm bar per epoch.
            mesh: A `jax.sharding.Mesh` with a "data" axis for data parallelism.
            max_in_flight: Unfused steps the host may queue before waiting for the device.
            prefetch: Fused chunks a background thread may prepare ahead (0: the next chunk
                is prepared in the caller's thread while the device runs the current one).
            population: Train N members in one fused program (a trainer only): an int N
                (seeds seed, seed+1, ...) or a dict of per-member lists, e.g.
                `{"learning_rate": [1e-3, 1e-2], "seed": [0, 1]}` (any hyperparameter the
                optimizer injects, plus "seed"). Params gain a leading member axis, metrics
                and history hold arrays of shape (N,); `state.member(i)` is member i alone.
                Resuming a population's State continues it (leave population out).

        Returns:
            The final State (never donated).

        Example:
            >>> state = loop.run(batches, epochs=3, fuse=True)
            >>> state.status, state.epoch, sorted(state.metrics)
            ('completed', 2, ['loss'])
        """
        check_run_options(epochs, iterations, jit, progress, max_in_flight, prefetch)
        observer = None
        if progress:
            from ._distributed import is_main_process
            from .handlers.progress import ProgressBar

            # Side effects happen once: the bar is drawn by process 0 only.
            observer = ProgressBar.for_data(data, iterations) if is_main_process() else None
        return run_loop(
            self,
            data,
            init_state,
            epochs=epochs,
            iterations=iterations,
            fuse=fuse,
            jit=jit,
            observer=observer,
            mesh=mesh,
            max_in_flight=max_in_flight,
            prefetch=prefetch,
            population=population,
        )


def _known_metrics() -> tuple[str, ...]:
    from ._metrics import METRICS

    return tuple(METRICS)


def _check_accumulate(accumulate: str) -> str:
    from ._metrics import ACCUMULATORS

    if accumulate not in ACCUMULATORS:
        raise ValueError(
            f"accumulate={accumulate!r} is not an accumulator; accepted values: "
            f"{', '.join(ACCUMULATORS)}"
        )
    return accumulate


def trainer(
    model: Any,
    loss: Any,
    optimizer: Any,
    *,
    log: int = 0,
    seed: int = 0,
    log_stream: TextIO | None = None,
) -> Loop:
    """A supervised training loop that tracks "loss".

    Args:
        model: A flax.linen module (or any object with `.init(rng, x)` / `.apply(vars, x)`,
            an nnx/equinox module, or an `(init_fn, apply_fn)` pair).
        loss: A loss name or `callable(y_true, y_pred) -> scalar`; cross-entropies take logits.
        optimizer: An optax transformation, or "sgd", "adam", "adamw".
        log: Print a line every `log` iterations (0: silent).
        seed: Seeds parameter initialization and dropout.
        log_stream: Where log lines go (stdout by default).

    Example:
        >>> import fuseloop as fl, optax
        >>> loop = fl.trainer(fl.models.mlp([32, 10]), "sparse_categorical_cross_entropy",
        ...                   optax.adam(1e-3), log=50)
    """
    if isinstance(log, bool) or not isinstance(log, int) or log < 0:
        raise ValueError(f"log={log!r} must be a non-negative int (0 disables logging)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int")
    program = trainer_program(model, loss, optimizer, seed)
    built = Loop(program, metrics=default_metrics(program))
    if log:
        from .handlers.log import attach_trainer_log

        built = attach_trainer_log(built, log, log_stream)
    return built


def evaluator(model: Any, loss: Any = None) -> Loop:
    """An evaluation loop: `evaluator(model).run(data, params_or_state)`.

    Args:
        model: The model, in any form `trainer` takes.
        loss: None, or a loss name or `callable(y_true, y_pred)`: then the loop tracks
            "loss", a mean over the examples.

    Example:
        >>> variables = model.init(jax.random.PRNGKey(0), batches[0][0])
        >>> scores = evaluator(model, "sparse_categorical_cross_entropy").metric("accuracy")
        >>> sorted(scores.run(val_batches, variables).metrics)
        ['accuracy', 'loss']
    """
    program = evaluator_program(model, loss)
    return Loop(program, metrics=default_metrics(program))


def loop(
    step_fn: Callable[[Any, Any], Any], init_fn: Callable[[Any, Any], Any] | None = None
) -> Loop:
    """A custom loop around `step_fn(batch, step_state) -> step_state` (pure, jit-able).

    Args:
        step_fn: One step.
        init_fn: `init_fn(first_batch, init_state) -> step_state` (default: `init_state`).

    Example:
        >>> count = fl.loop(lambda batch, s: {"n": s["n"] + 1})
        >>> int(count.run([(0, 0)] * 3, {"n": 0}).step_state["n"])
        3
    """
    if not callable(step_fn):
        raise ValueError(f"step_fn={step_fn!r} must be callable(batch, step_state)")
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"init_fn={init_fn!r} must be callable(first_batch, init_state)")
    return Loop(custom_program(step_fn, init_fn))
