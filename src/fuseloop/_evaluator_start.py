"""An evaluator run's start-of-run checks, made before the run that validates trains.

`Loop.validate`'s handler (`handlers/validate.py`) and a multi-epoch dispatch's device
validation (`engine/device_validation.py`) both check the validation data so, with the
variables the training starts from, so a bad validation batch fails before the first
epoch trains rather than after it.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from ._checks import Checker
from ._label_checks import labels_of
from ._model_warnings import warn_about_model
from ._variables_diff import UNWRAPPED

__all__ = ["arrays_first_batch", "check_evaluator_start", "note_validation"]


def arrays_first_batch(source: Any) -> Any:
    """Rows of an `fl.data.arrays` source's host copy standing in for its first batch:
    they have its shapes and dtypes, and nothing is read from a device."""
    return jax.tree.map(lambda leaf: leaf[: source.batch_size], (source.x, source.y))


def check_evaluator_start(
    program: Any,
    verdicts: dict[Any, Any],
    first: Any,
    params: Any,
    arrays: Any = None,
    metrics: Any = (),
    data: Any = None,
) -> Checker:
    """Checks `first` (the validation data's first batch) as the evaluator `program`'s run
    would, with `params` (the training's variables), and every label of `arrays` (an
    `fl.data.arrays` source) where given; with the evaluator's `metrics`, the labels of
    `data` (the whole validation data, where it is in memory) are held to the class
    metrics' rule too. Returns the Checker, for further batches."""
    checker = Checker(program, verdicts)
    checker.first(first, arrays)
    if arrays is not None:
        checker.dataset(arrays)
    checker.variables({"params": params})
    if metrics:
        with warnings.catch_warnings():  # said by the evaluator's own run, not twice
            warnings.simplefilter("ignore")
            rule = warn_about_model(program, {"params": params}, first, verdicts, metrics)
        checker.labels.classes(rule, labels_of(data), first)
    return checker


def note_validation(error: BaseException, what: str) -> None:
    """Notes on `error` that `what` (e.g. "the evaluator's start checks of") raised it
    for validate()'s data, not the training data its "data:" would otherwise suggest."""
    error.add_note(
        f"fuseloop: raised by {what} validate()'s data: a 'data:' above is the validation "
        f"data, its epoch and iteration the evaluator run's own"
    )
    if UNWRAPPED.strip() in str(error):  # "init_state" above: the loop's params
        error.add_note(
            "fuseloop: validate gives the evaluator the training loop's "
            "step_state['params']: a custom loop must keep the model's whole variables "
            "there ({'params': ...}, as model.init returns them), not variables['params']"
        )
