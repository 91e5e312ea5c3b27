"""`Loop.validate`: evaluate the trainer's current params on validation data.

The evaluation loop is built once, when the handler is attached (by `Loop.validate`, which
hands it here), so its compiled programs are cached on it: it compiles once per process,
not once per epoch. It reads the trainer's params and never donates or changes them (an
evaluator step returns its state untouched and only its metric accumulators are donated),
so validation cannot change the training trajectory.
"""

from __future__ import annotations

from typing import Any

import jax

from .._batch_checks import require_pair
from .._data import as_host_array, as_source, warn_left_out
from .._evaluator_start import arrays_first_batch, check_evaluator_start, note_validation
from .._events import Event, normalize_event
from .._fusion import FusionError, resolve_fuse
from .._metrics import VALIDATION_PREFIX, MetricSpec, batch_size
from .._placement import require_divides
from .._population import silence_stopped
from .._shards import refuse_short_batch
from .._state import State
from .._types import Status
from ..models import variables_given, without_params

__all__ = ["Validator", "check_validation", "evaluable_metrics", "validation_names"]


def evaluable_metrics(metrics: tuple[MetricSpec, ...], has_loss: bool) -> tuple[MetricSpec, ...]:
    """The trainer's metrics an evaluator can compute.

    Those are the functions of (y_true, y_pred), and the loss when the evaluator is given
    one (it is produced in the step's aux["loss"]).

    Example:
        >>> specs = loop.metric("accuracy").metrics
        >>> [s.name for s in evaluable_metrics(specs, True)]
        ['loss', 'accuracy']
    """
    kept = []
    for spec in metrics:
        if spec.fn is not None or (spec.source == "loss" and has_loss):
            kept.append(spec)
    return tuple(kept)


def validation_names(evaluation: Any) -> set[str]:
    """The metric names a validation with the evaluator Loop `evaluation` adds.

    Example:
        >>> from types import SimpleNamespace as Spec
        >>> sorted(validation_names(Spec(metrics=(Spec(name="loss"), Spec(name="accuracy")))))
        ['validation_accuracy', 'validation_loss']
    """
    return {VALIDATION_PREFIX + m.name for m in evaluation.metrics}


def _one_source(value: Any) -> str:
    """What arrays in validate's event slot mean: Keras's validation_data=(x_val, y_val)."""
    if not (hasattr(value, "shape") or isinstance(value, (list, tuple))):
        return ""
    return (
        ". The data is one argument: validate(model, data) takes a source such as "
        "fl.data.arrays(x, y, batch_size=..., shuffle=False, drop_remainder=False)"
    )


def check_validation(
    model: Any, data: Any, fuse: Any, specs: tuple[MetricSpec, ...], event: Any = None
) -> None:
    """Raises a ValueError naming what `Loop.validate` cannot use.

    That is: no model, one-shot data, a list of batches that are not (x, y) pairs, a
    `fuse` a validation run does not take, no metric an evaluator can compute, or the
    "started" event (the first epoch starts the metrics afresh: the validation would be
    lost).

    Example:
        >>> check_validation(model, iter(val_batches), False, loop.metrics)
        Traceback (most recent call last):
        ...
        ValueError: data: validation data must be re-iterable ...
    """
    if model is None:
        raise ValueError("model=None: validate needs the model to evaluate")
    if event is not None and normalize_event(event, hint=_one_source) is Event.STARTED:
        raise ValueError(
            "validate(event='started'): the run's metrics start afresh with its first "
            "epoch, so a validation before it would be lost. For the score of the params "
            "a run starts from, run fl.evaluator(model, loss).run(data, variables) before "
            "it, or validate at event='epoch_started' (each epoch records the validation "
            "of the params it starts from)"
        )
    if as_source(data, reader="validate").one_shot:
        raise ValueError(
            "data: validation data must be re-iterable (a list of batches, a callable "
            "returning an iterator, or fl.data.arrays(...)); a one-shot iterator or "
            "generator would be exhausted after the first validation"
        )
    if fuse == "auto":
        raise ValueError(
            "fuse='auto' is not supported for validation; accepted values: "
            "False, True, or a positive int chunk size"
        )
    if isinstance(data, (list, tuple)) and data:
        # Now, not after the first epoch's training, where the evaluator would meet it.
        require_pair(data[0], "the validation data's first batch", data)
    chunked = resolve_fuse(fuse, True)  # validates the value now, not at the first epoch's end
    if chunked is not None:
        _refuse_short_batches(data, fuse)
    if not specs:
        raise ValueError(
            "validate: the loop has no metric an evaluator can compute (a loss, or a "
            "metric of (y_true, y_pred)); add one with Loop.metric(...) before "
            "Loop.validate(...)"
        )
    _warn_dropped_examples(data)


def _refuse_short_batches(data: Any, fuse: Any) -> None:
    """Refuses (FusionError) a fused validation of host batches of two sizes.

    It is refused when the validation is attached, not after the first epoch's training,
    where the fused validation run would meet the odd batch. A fused chunk stacks batches
    of one shape (docs/data.md), and validation data usually ends with a short batch
    (`drop_remainder=False`, which `Loop.validate` asks for). A device-resident source runs
    that batch as a step of its own shape, so only host data is refused; a callable's
    batches are only seen when the validation runs.
    """
    fixes = (
        "use fuse=False for the validation run (the default), "
        "fl.data.arrays(..., drop_remainder=False, device=True) (a device-resident source "
        "runs its short last batch as a step of its own), or batches of one size"
    )
    if hasattr(data, "short_batch") and not getattr(data, "resident", False):
        short = data.short_batch
        if short and data.n > data.batch_size:  # one short batch alone has one shape
            raise FusionError(
                f"validate(fuse={fuse!r}): the validation data's last batch holds {short} "
                f"of its {data.n} examples, not batch_size={data.batch_size}, and a fused "
                f"validation run stacks batches of one shape; {fixes}"
            )
    if isinstance(data, (list, tuple)) and data:
        sizes = [_examples(batch) for batch in data]
        odd = next((i for i, size in enumerate(sizes) if size != sizes[0]), None)
        if odd is not None:
            raise FusionError(
                f"validate(fuse={fuse!r}): validation batch {odd} holds {sizes[odd]} "
                f"examples and batch 0 holds {sizes[0]}, and a fused validation run stacks "
                f"batches of one shape; {fixes}"
            )


def _examples(batch: Any) -> int:
    """A pair's examples are y's rows (a graph batch's x holds nodes and edges)."""
    if isinstance(batch, tuple) and len(batch) == 2:
        return batch_size(batch[1], batch[0])
    return batch_size(batch)


def _warn_dropped_examples(data: Any) -> None:
    """Warns where `data` drops examples from every validation.

    `fl.data.arrays` drops a short last batch by default, which in validation data leaves
    examples out of every validation metric without a word.
    """
    warn_left_out(
        data,
        "validate",
        "every validation metric",
        "pass fl.data.arrays(..., drop_remainder=False, shuffle=False)",
    )


class Validator:
    """Runs an evaluator Loop on `state.params` and adds `validation_<name>` metrics.

    `Loop.validate` builds the evaluator Loop once (so it compiles once per process) and
    hands it here; this module does not build loops itself.

    Args:
        loop: The evaluator Loop (the model, the trainer's loss and its evaluable metrics).
        data: Re-iterable validation data (a list of batches, a callable returning an
            iterator, or `fl.data.arrays(...)`).
        fuse: The validation run's `fuse` (False, True, or a chunk size).

    Example:
        >>> scores = fl.evaluator(model, "sparse_categorical_cross_entropy")
        >>> validator = Validator(scores, val_batches)
        >>> state = loop.run(batches)
        >>> sorted(validator.evaluate(state.params))
        ['loss']
    """

    # It evaluates the params, which a fused run's iteration events lack (engine/options.py).
    fuseloop_reads_step_state = True
    # It reads `self.data`: where that is the run's own, it may change the run's pass
    # (engine/bus.py, `reopens_first_pass`).
    fuseloop_reads_data = True

    # On device-resident data the engine runs this handler inside a multi-epoch dispatch
    # (engine/device_monitors.py), with the same arithmetic.
    on_device = "validate"

    def __init__(self, loop: Any, data: Any, fuse: Any = False):
        self.loop, self.data, self.fuse = loop, data, fuse
        self._verdicts: dict[Any, Any] = {}  # the start checks' model verdicts, per signature

    def begin(self, state: State) -> None:
        """At the training run's start, checks the validation data as the evaluator would.

        That is its first batch, with the params the training starts from, and every label
        of an `fl.data.arrays` source or a list of batches: bad validation data then fails
        before the first epoch trains, not after it. A callable's batches are only seen
        when the validation runs; a population's members are checked then too.
        """
        try:
            _refuse_what_processes_cannot_feed(self.data)
        except ValueError as error:
            note_validation(error, "the evaluator's start checks of")
            raise
        first = _first_batch(self.data)
        params = variables_given(state, "init_state")  # an equinox module kept as params too
        if first is None or params is None or state.population is not None:
            return
        arrays = self.data if _in_arrays(self.data) else None
        try:
            program, metrics = self.loop.program, self.loop.metrics
            checker = check_evaluator_start(
                program, self._verdicts, first, params, arrays, metrics, self.data
            )
            for i, batch in enumerate(self.data[1:] if arrays is None else (), start=1):
                where, labels = f"the validation data's batch {i}", _labels_read(batch)
                checker.labels.batch(checker.fit.labels, labels, where)
        except Exception as error:
            note_validation(error, "the evaluator's start checks of")
            raise

    def evaluate(self, params: Any, population: int | None = None) -> dict[str, Any]:
        """The evaluator's metrics on `params` (unprefixed).

        With `population`, params carry a leading member axis and each metric is an array
        of one value per member.
        """
        return dict(self._run(params, population).metrics)

    def _run(self, params: Any, population: int | None) -> State:
        """The evaluator's run on `params`, its compile count in its stats."""
        # A signal arriving meanwhile is caught by the training run's guard (nested runs
        # defer to the outermost one), which halts at its next host boundary.
        members = {} if population is None else {"population": population}
        try:
            # A nested run: its data's warnings are said once per training run (_narrowing).
            result: State = self.loop.run(self.data, params, fuse=self.fuse, **members)
        except Exception as error:
            note_validation(error, "the evaluator's run over")
            raise
        return result

    def __call__(self, state: State) -> tuple[Status, State]:
        """Evaluates the State's params and adds the validation metrics to its history."""
        params = state.params
        if params is None:
            raise ValueError(_no_params(state.step_state))
        result = self._run(params, state.population)
        measured = silence_stopped(state, dict(result.metrics))
        # The training run's count so far, as the next epoch-end handler reads it (the run
        # counts its evaluators' compiles again at its end: the same total).
        state.stats["compiles"] = state.stats.get("compiles", 0) + result.stats["compiles"]
        metrics = dict(state.metrics)
        metrics.update({VALIDATION_PREFIX + name: value for name, value in measured.items()})
        return "continue", state.replace(metrics=metrics)


def _refuse_what_processes_cannot_feed(data: Any) -> None:
    """Refuses now what the first validation would under several processes.

    That is a short last batch fed from the host (each process feeds an equal share), or on
    the device a batch that does not divide over the global mesh (every device) the
    processes validate on.
    """
    if jax.process_count() == 1 or not _in_arrays(data):
        return
    short = getattr(data, "short_batch", 0)
    if not getattr(data, "resident", False):
        if short:
            refuse_short_batch(short, data.batch_size)
        return
    require_divides(data.batch_size, jax.device_count())
    if short:
        require_divides(short, jax.device_count(), short=True)


def _first_batch(data: Any) -> Any:
    """The first batch of in-memory validation data, else None.

    Rows of an `fl.data.arrays` source stand in for it (its shapes and dtypes).
    """
    if _in_arrays(data):
        return arrays_first_batch(data)
    if isinstance(data, (list, tuple)) and data:
        return _as_run_reads(data[0])
    return None


def _labels_read(batch: Any) -> Any:
    """An `(x, y)` batch with y as the run reads it (`_as_run_reads`), x as it is.

    Only the labels are checked: a CUDA tensor x is not copied to the host for nothing.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return (batch[0], _as_run_reads(batch[1]))
    return batch


def _as_run_reads(batch: Any) -> Any:
    """`batch` with its leaves as the evaluator's run reads them.

    A data frame, a torch tensor or a number becomes an array (`as_host_array`).
    """
    return jax.tree.map(as_host_array, batch)


def _in_arrays(data: Any) -> bool:
    """Whether `data` is an `fl.data.arrays` source (its labels can be read at once)."""
    return getattr(data, "host_labels", None) is not None and hasattr(data, "batch_size")


def _no_params(step_state: Any) -> str:
    """Why a State handed to validate holds no params, and the fix."""
    if step_state is None:
        return (
            "validate: the State has no params here (inside iteration events of a fused "
            "loop, step_state is None); validate on an epoch event (the default), or use "
            "fuse=False"
        )
    return (
        f"validate: it evaluates step_state['params'], and this loop's step state is "
        f"{without_params(step_state)}; keep the model's variables under "
        f"step_state['params'] (a dict step state), as fl.trainer does"
    )
