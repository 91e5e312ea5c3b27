"""Checks of `Loop.metric`'s arguments: each raises a ValueError that names the argument
and what it accepts."""

from __future__ import annotations

from typing import Any

from ._metrics import ACCUMULATORS, ALIASES, METRICS

__all__ = ["known_metrics", "check_accumulate", "check_metric_name", "refuse_loss_metric"]


def known_metrics() -> tuple[str, ...]:
    """The names of the built-in metrics, and their Keras spellings ("mae", "acc", ...); a
    loss's Keras spelling ("binary_crossentropy") is not one: a custom step's own entry."""
    return (*METRICS, *(alias for alias, name in ALIASES.items() if name in METRICS))


def check_accumulate(accumulate: str) -> str:
    """`accumulate` itself, when it names an accumulator."""
    if accumulate not in ACCUMULATORS:
        raise ValueError(
            f"accumulate={accumulate!r} is not an accumulator; accepted values: "
            f"{', '.join(ACCUMULATORS)}"
        )
    return accumulate


def check_metric_name(name: Any, metric: Any = None) -> None:
    """`metric(metric, name=...)`: None or a non-empty str, not another built-in metric's
    (`.metric("accuracy", "mse")`, Keras's list split in two, kept accuracy as "mse")."""
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(
            f"name={name!r} must be a non-empty str (the key in state.metrics) or None "
            f"for the metric's own name"
        )
    known = ALIASES.get(metric, metric) if isinstance(metric, str) else None
    renamed_to = ALIASES.get(name, name) if isinstance(name, str) else None
    if known in METRICS and renamed_to in METRICS and renamed_to != known:
        raise ValueError(
            f"metric({metric!r}, {name!r}): the second argument is name=, the key the metric "
            f"is kept under, and {name!r} is another built-in metric, so {metric!r} would be "
            f"reported as {name!r}. Add one metric per call: .metric({metric!r}).metric({name!r})"
        )


def refuse_loss_metric(metric: Any, kind: str, tracked: bool) -> None:
    """`.metric("loss")` on a trainer or an evaluator (`tracked`: it tracks "loss" itself):
    a ValueError that says where the loss already is, or how to have it."""
    if metric != "loss" or kind not in ("trainer", "evaluator"):
        return
    if tracked:
        raise ValueError(
            f"metric='loss': this {kind} already tracks its loss as state.metrics['loss']; "
            f"to track another loss too, pass it as a callable with a name of its own, "
            f"e.g. .metric(fn, name='mse')"
        )
    raise ValueError(
        "metric='loss': an evaluator tracks a loss once it is given one: fl.evaluator(model, loss)"
    )
