"""An evaluator run's start-of-run checks, made before the run that validates trains.

`Loop.validate`'s handler (`handlers/validate.py`) and a multi-epoch dispatch's device
validation (`engine/device_validation.py`) both check the validation data so, with the
variables the training starts from, so a bad validation batch fails before the first
epoch trains rather than after it.
"""

from __future__ import annotations

from typing import Any

import jax

from ._checks import Checker

__all__ = ["arrays_first_batch", "check_evaluator_start"]


def arrays_first_batch(source: Any) -> Any:
    """Rows of an `fl.data.arrays` source's host copy standing in for its first batch:
    they have its shapes and dtypes, and nothing is read from a device."""
    return jax.tree.map(lambda leaf: leaf[: source.batch_size], (source.x, source.y))


def check_evaluator_start(
    program: Any, verdicts: dict[Any, Any], first: Any, params: Any, arrays: Any = None
) -> Checker:
    """Checks `first` (the validation data's first batch) as the evaluator `program`'s run
    would, with `params` (the training's variables), and every label of `arrays` (an
    `fl.data.arrays` source) where given. Returns the Checker, for further batches."""
    checker = Checker(program, verdicts)
    checker.first(first, arrays)
    if arrays is not None:
        checker.dataset(arrays)
    checker.variables({"params": params})
    return checker
