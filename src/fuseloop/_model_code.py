"""Errors in a model's own code (a name it never defined, a flax module used against
linen's rules), told apart from x that does not fit it: no reshaping of x would help."""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax
import numpy as np

from ._model_fit_advice import first_line

__all__ = ["model_code_error"]

# flax.linen's errors for a module's own code (a layer made outside `setup` or `@compact`,
# an attribute set where modules forbid it, a name used twice): never the data's doing.
_MODULE_CODE_ERRORS = frozenset(
    {
        "AssignSubModuleError",
        "CallCompactUnboundModuleError",
        "CallSetupUnboundModuleError",
        "DescriptorAttributeError",
        "MultipleMethodsCompactError",
        "NameInUseError",
        "ReservedModuleAttributeError",
        "SetAttributeFrozenModuleError",
        "SetAttributeInModuleSetupError",
    }
)
# flax.linen's own message for a module attribute that does not exist.
_MODULE_ATTRIBUTE = re.compile(r'^"\w+" object has no attribute "\w+"')


def _in_model_code(error: BaseException) -> bool:
    """Whether `error` comes from the model's code whatever x holds: a name it never
    defined, an import it lacks, a flax module used against linen's rules, or an attribute
    missing from a module or a library (not from x or one of its containers)."""
    if isinstance(error, (NameError, ImportError)):
        return True
    if type(error).__name__ in _MODULE_CODE_ERRORS and "flax" in type(error).__module__:
        return True
    if not isinstance(error, AttributeError):
        return False
    owner = getattr(error, "obj", None)  # set by Python, not by flax's own AttributeError
    if owner is None:
        return bool(_MODULE_ATTRIBUTE.match(str(error)))
    return not isinstance(owner, (np.ndarray, np.generic, jax.Array, Mapping, list, tuple))


def model_code_error(error: BaseException, doing: str) -> ValueError | None:
    """The ValueError for an error in the model's own code met while `doing` (so not
    blamed on x's shape); None for other errors.

    Example:
        >>> error = model_code_error(NameError("name 'scale' is not defined"), "applying it")
        >>> str(error).startswith("model: applying it fails with NameError: name 'scale'")
        True
        >>> model_code_error(TypeError("dot_general requires contracting dims"), "applying it")
    """
    if not _in_model_code(error):
        return None
    return ValueError(
        f"model: {doing} fails with {first_line(error)}, an error in the model's own code "
        f"that no shape of x would avoid (the traceback above shows where). Fix the model "
        f"and run again"
    )
