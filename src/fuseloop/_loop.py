"""`Loop`, its builders and `run` (handler builders: `_loop_handlers`; factories: `_factories`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import _foreign_keywords as keywords
from ._data import warn_left_out
from ._distributed import all_processes
from ._events import Registration, attached, make_filter, normalize_event
from ._loop_args import (
    check_handler,
    check_init_state,
    describe_loop,
    kept_evaluation,
    refuse_second_validation,
    refuse_validation_names,
)
from ._loop_handlers import HandlerBuilders
from ._metric_args import check_accumulate, check_metric_name, known_metrics, refuse_loss_metric
from ._metrics import MetricSpec, resolve_metric
from ._state import State
from ._step import Program, check_loop_program
from ._types import Accumulate, EventLike, FilterLike, Fuse, Handler
from .engine import run_loop
from .engine.options import check_run_options
from .engine.programs import ProgramCache
from .models import weights_of_module

__all__ = ["Loop"]


@dataclass(frozen=True)
class Loop(HandlerBuilders):
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
        programs = self._programs if set(changes) <= {"registrations"} else ProgramCache()
        return replace(self, _programs=programs, **changes)

    def __post_init__(self) -> None:
        check_loop_program(self.program)  # `fl.Loop(step_fn)` is told to use fl.loop

    __repr__ = describe_loop

    # ----------------------------------------------------------------- builders
    def metric(
        self, metric: Any, name: str | None = None, accumulate: Accumulate = "running_average"
    ) -> Loop:
        """Adds a metric, computed on the device each step and accumulated there.

        Args:
            metric: A name ("accuracy", "precision", "recall", "mean_absolute_error",
                "mean_squared_error", or Keras's "acc", "mae", "mse", kept as the key) or
                `callable(y_true, y_pred)` returning per-example
                values (as Keras metric functions do) or one scalar for the batch.
                "accuracy", "precision" and "recall" read one output per example as a
                binary logit, and so every output under "binary_cross_entropy" (one
                binary label each: multi-label); several outputs otherwise as classes
                (precision and recall then micro-averaged over the classes, which for
                one label per example equals accuracy).
            name: The key in `state.metrics` (default: the metric's name).
            accumulate: "running_average" (the mean over the epoch's examples for built-in
                metrics, the loss and a callable's per-example values; for a callable's
                scalar, the mean of its per-batch values) or "running_sum".

        Example:
            >>> state = loop.metric("accuracy").run(batches, epochs=1)
            >>> sorted(state.metrics)
            ['accuracy', 'loss']
        """
        check_metric_name(name, metric)
        refuse_loss_metric(metric, self.program.kind, any(m.name == "loss" for m in self.metrics))
        if (
            self.program.kind == "custom"
            and isinstance(metric, str)
            and metric not in known_metrics()
        ):
            spec = MetricSpec(name or metric, None, check_accumulate(accumulate), source=metric)
        else:
            spec = resolve_metric(metric, name, accumulate)
        if any(m.name == spec.name for m in self.metrics):
            raise ValueError(f"metric name {spec.name!r} is already used; pass name=...")
        refuse_validation_names({spec.name}, self._validated_names())
        return self._with(metrics=self.metrics + (spec,))

    def _validated_names(self) -> set[str]:
        """The `validation_*` metrics the attached `validate` handlers add."""
        from .handlers.validate import Validator, validation_names

        names: set[str] = set()
        for r in self.registrations:
            if isinstance(r.handler, Validator):
                names |= validation_names(r.handler.loop)
        return names

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
        check_handler(handler, "handler", "None | status | (status, state)", self.registrations)
        if hasattr(handler, "check_optimizer") and self.program.kind == "trainer":
            handler.check_optimizer(self.program)  # ReduceLROnPlateau, however it is attached
        added = attached(event, handler, make_filter(filter), name)
        return self._with(registrations=self.registrations + added)

    def observe(
        self,
        event: EventLike,
        fn: Callable[[State], None],
        filter: FilterLike = "always",
        name: str = "",
    ) -> Loop:
        """Attaches `fn(state)` to `event` as a handler that only observes.

        `fn` must return None (anything else raises a ValueError): it cannot halt or change
        the State, so it never ends a multi-epoch dispatch (`run(fuse="run")`); its events
        are replayed after the dispatch, in the unfused order, with each epoch's own
        metrics. Inside a replayed epoch `state.step_state` is None, as in the iteration
        events of a fused loop (docs/design.md §9). With several processes it runs on
        process 0 only, unless marked with `fl.all_processes`.

        Example:
            >>> seen = []
            >>> watched = loop.observe("epoch_completed", lambda s: seen.append(s.epoch))
            >>> data = fl.data.arrays(np.ones((8, 4), np.float32), np.zeros(8, np.int32),
            ...                       batch_size=4, device=True)
            >>> watched.run(data, epochs=3, fuse="run").stats["dispatches"], seen
            (1, [0, 1, 2])
        """
        event = normalize_event(event)
        check_handler(fn, "fn", "None")
        registration = Registration(event, fn, make_filter(filter), name, observes=True)
        return self._with(registrations=self.registrations + (registration,))

    def _own_since(self, before: Loop) -> Loop:
        """This loop with the registrations `before` lacks marked as fuseloop's own
        (`Registration.own`): what one of its builders attached (a builder may move an
        earlier one, `_before_restores`, so they are told apart by identity)."""
        had = {id(r) for r in before.registrations}
        marked = tuple(r if id(r) in had else replace(r, own=True) for r in self.registrations)
        return self._with(registrations=marked)

    def _as_observers(self, before: int) -> Loop:
        """This loop with the registrations after the first `before` marked as observers
        (the writers attached by csv_log and tensorboard only look)."""
        marked = self.registrations[:before] + tuple(
            replace(r, observes=True) for r in self.registrations[before:]
        )
        return self._with(registrations=marked)

    @keywords.advise_foreign_keywords(keywords.HANDLER_ADVICE["validate"], owner="Loop")
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
        before handlers that monitor `validation_*`. The evaluation loop is built once (and
        found again for the same model and metrics), so it compiles once; it only reads params.

        Args:
            model: The model to evaluate (usually the trainer's).
            data: Re-iterable validation batches (list, callable, `fl.data.arrays`).
            event: When to validate (default: at the end of each epoch).
            filter: Which firings validate, e.g. `{"every": 5}`.
            fuse: The validation run's `fuse`: False, True or a chunk size. Fused host
                batches share one shape: a short last batch is refused (a `FusionError`)
                unless `fuse=False` or the source is `fl.data.arrays(..., device=True)`.

        Example:
            >>> state = loop.metric("accuracy").validate(model, val_batches).run(batches)
            >>> sorted(state.metrics)
            ['accuracy', 'loss', 'validation_accuracy', 'validation_loss']
        """
        from .handlers.validate import (
            Validator,
            check_validation,
            evaluable_metrics,
            validation_names,
        )

        loss = self.program.loss
        specs = evaluable_metrics(self.metrics, loss is not None)
        check_validation(model, data, fuse, specs, event)
        evaluation = kept_evaluation(self._programs, model, loss, specs, Loop)
        refuse_validation_names({m.name for m in self.metrics}, validation_names(evaluation))
        refuse_second_validation(self._validated_names() & validation_names(evaluation))
        validator = Validator(evaluation, data, fuse)
        begin = all_processes(validator.begin)  # each process checks its own validation
        built = self.observe("started", begin, name="validate:begin")
        return built.handle_event(event, validator, filter, name="validate")._own_since(self)

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
    @keywords.advise_foreign_keywords(keywords.RUN_ADVICE)
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
        """Runs the loop and returns the final State (never donated).

        Args:
            data: A list of `(x, y)` batches, a re-iterable, a callable returning an
                iterator, a one-shot iterator, or `fl.data.arrays(...)`.
            init_state: None (initialize from the first batch), variables, or a State to resume.
            epochs: Total number of epochs (a resumed run continues up to this many).
            iterations: Bound on iterations per epoch.
            fuse: False; True (chunks of 32); a chunk size; "auto" (the cost model's
                size); or "run". On resident data (`fl.data.arrays(..., device=True)`),
                "run", a size beyond the epoch, and "auto" when its size is, run many
                epochs per dispatch, split only where a handler that may halt or change
                the State fires (`state.stats["dispatch_splits"]`); host-fed chunks stay
                within an epoch.
            jit: False runs op by op for debugging (unfused only).
            progress: Show a tqdm bar per epoch.
            mesh: A `jax.sharding.Mesh` with a "data" axis for data parallelism.
            max_in_flight: Unfused steps the host may queue before waiting for the device.
            prefetch: Fused chunks a background thread may prepare ahead (0: the caller's
                thread prepares the next chunk while the device runs the current one).
            population: Train N members in one fused program (a trainer only): an int N
                (seeds seed, seed+1, ...) or a dict of per-member lists (any hyperparameter
                the optimizer injects, and "seed"), e.g. `{"learning_rate": [1e-3, 1e-2]}`.
                A dict without "seed" seeds member i with seed+i too; give `"seed": [0, 0]`
                to start every member from the same initial weights (a clean rate sweep).
                Params gain a leading member axis, metrics and history hold arrays of shape
                (N,); `state.member(i)` is member i alone. A population's State resumes as one.

        Example:
            >>> state = loop.run(batches, epochs=3, fuse=True)
            >>> state.status, state.epoch, sorted(state.metrics)
            ('completed', 2, ['loss'])
        """
        check_run_options(epochs, iterations, jit, progress, max_in_flight, prefetch)
        check_init_state(init_state, self.program.kind, population, data)
        if self.program.kind in ("trainer", "evaluator"):
            init_state = weights_of_module(init_state, "init_state", self.program.model)
        if self.program.kind == "evaluator":
            warn_left_out(
                data,
                "evaluator run",
                "its metrics",
                "pass fl.data.arrays(..., drop_remainder=False) to evaluate every example "
                "(with device=True for a fused run: the short batch runs as a step of its own)",
            )
        observer = None
        if progress:  # the display, imported only when asked for and passed in as observer
            from .handlers.progress import run_progress_bar

            observer = run_progress_bar(data, iterations)
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
