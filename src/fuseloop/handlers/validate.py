"""`Loop.validate`: evaluate the trainer's current params on validation data.

The evaluation loop is built once, when the handler is attached, so its compiled programs
are cached on it: it compiles once per process, not once per epoch. It reads the trainer's
params and never donates or changes them (an evaluator step returns its state untouched and
only its metric accumulators are donated), so validation cannot change the training
trajectory.
"""

from __future__ import annotations

from typing import Any

from .._data import as_source
from .._fusion import resolve_fuse
from .._metrics import MetricSpec
from .._state import State

__all__ = ["Validator"]

PREFIX = "validation_"


def _evaluable(metrics: tuple[MetricSpec, ...], has_loss: bool) -> tuple[MetricSpec, ...]:
    """The trainer's metrics an evaluator can compute: functions of (y_true, y_pred), and
    the loss when the evaluator is given one (it is produced in the step's aux["loss"])."""
    kept = []
    for spec in metrics:
        if spec.fn is not None or (spec.source == "loss" and has_loss):
            kept.append(spec)
    return tuple(kept)


class Validator:
    """Runs one evaluator Loop on `state.params` and adds `validation_<name>` metrics.

    Args:
        model: The model to evaluate (the trainer's model, or one that accepts its params).
        data: Re-iterable validation data (a list of batches, a callable returning an
            iterator, or `fl.data.arrays(...)`); a one-shot iterator would be exhausted by
            the first validation, so it is refused.
        loss: The trainer's loss spec (None: no validation loss).
        metrics: The trainer's metric specs.
        fuse: The validation run's `fuse` (False, True, or a chunk size).

    Example:
        >>> loop = loop.metric("accuracy").validate(model, val_batches)  # doctest: +SKIP
        >>> state.metrics["validation_accuracy"]  # doctest: +SKIP
    """

    def __init__(self, model: Any, data: Any, loss: Any, metrics: tuple[MetricSpec, ...],
                 fuse: Any = False):
        from .._loop import Loop
        from .._step import evaluator_program

        if model is None:
            raise ValueError("model=None: validate needs the model to evaluate")
        if as_source(data).one_shot:
            raise ValueError(
                "data: validation data must be re-iterable (a list of batches, a callable "
                "returning an iterator, or fl.data.arrays(...)); a one-shot iterator or "
                "generator would be exhausted after the first validation"
            )
        if fuse == "auto":
            raise ValueError("fuse='auto' is not supported for validation; accepted values: "
                             "False, True, or a positive int chunk size")
        resolve_fuse(fuse, True)  # validates the value now, not at the first epoch's end
        specs = _evaluable(tuple(metrics), loss is not None)
        if not specs:
            raise ValueError(
                "validate: the loop has no metric an evaluator can compute (a loss, or a "
                "metric of (y_true, y_pred)); add one with Loop.metric(...) before "
                "Loop.validate(...)"
            )
        self.data, self.fuse = data, fuse
        self.loop = Loop(evaluator_program(model, loss), metrics=specs)

    def evaluate(self, params: Any) -> dict[str, float]:
        """The evaluator's metrics on `params` (unprefixed)."""
        # A signal arriving meanwhile is caught by the training run's guard (nested runs
        # defer to the outermost one), which halts at its next host boundary.
        result = self.loop.run(self.data, params, fuse=self.fuse)
        return dict(result.metrics)

    def __call__(self, state: State) -> tuple[str, State]:
        params = state.params
        if params is None:
            raise ValueError(
                "validate: the State has no params here (inside iteration events of a fused "
                "loop, step_state is None); validate on an epoch event (the default), or use "
                "fuse=False"
            )
        measured = self.evaluate(params)
        metrics = dict(state.metrics)
        metrics.update({PREFIX + name: value for name, value in measured.items()})
        return "continue", state.replace(metrics=metrics)
