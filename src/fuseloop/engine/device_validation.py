"""The validation data a multi-epoch dispatch validates on: placed, ordered and checked.

A whole run on device-resident data runs `validate` inside its dispatch
(`device_monitors`), so the evaluator Loop that `Loop.validate` built never runs on the
host. The checks its run would make at its start (the first batch against the model and
the loss, every label of the dataset in its loss's range) are made here instead, once,
before the first dispatch: a bad validation label is the same ValueError whether the
validation runs on the host or on the device (docs/reliability.md).
"""

from __future__ import annotations

from typing import Any

from .._evaluator_start import arrays_first_batch, check_evaluator_start, note_validation
from .._placement import device_int
from .population import first_member
from .programs import Programs, kept_order

__all__ = ["validation_inputs"]


def validation_inputs(work: Any, programs: Any, placement: Any, run: Any) -> tuple[Any, ...] | None:
    """The validation data on the device and its order (the evaluator's epoch 0), checked
    as the evaluator's own run checks them (None: no validation on the device).

    The order is computed on the device once per source and kept beside it
    (`kept_order`: the dispatch only reads it), so a later run launches no program for it.
    """
    v = work.validation
    if v is None:
        return None
    data = v.source.put(placement.replicated)  # moved once, kept by the source
    _check(v, run)
    order = kept_order(v.source, 0, lambda: programs.epoch_order(v.source)(device_int(0))[0])
    return data, order


def _check(v: Any, run: Any) -> None:
    """The evaluator run's start-of-run checks on the validation source, with the variables
    the training starts from (a population's first member: the members share shapes)."""
    step_state = run.carry.step_state
    if run.members is not None:
        step_state = first_member(step_state)
    params = step_state.get("params") if isinstance(step_state, dict) else None
    if params is None:
        return  # validate itself refuses a State without params at the first epoch's end
    first = arrays_first_batch(v.source)  # every label is checked on the host copy
    program, verdicts, metrics = v.loop.program, Programs(v.loop).cache.verdicts, v.loop.metrics
    try:
        check_evaluator_start(program, verdicts, first, params, v.source, metrics, v.source)
    except Exception as error:
        note_validation(error, "the evaluator's start checks of")
        raise
