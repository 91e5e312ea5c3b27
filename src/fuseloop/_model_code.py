"""Errors in a model's own code (a name it never defined, a flax module used against
linen's rules), told apart from x that does not fit it: no reshaping of x would help."""

from __future__ import annotations

import re
from typing import Any, NoReturn

import jax
import numpy as np

from ._model_fit_advice import first_line

__all__ = ["KEPT", "kept_as_raised", "model_code_error", "model_error", "raise_from"]

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


def _in_model_code(error: BaseException, x: Any) -> bool:
    """Whether `error` comes from the model's code whatever x holds: a name it never
    defined, an import it lacks, a flax module used against linen's rules, or an attribute
    missing from a module or a library (not from an array, nor from a container of x's
    own types: its dict, tuple, flax struct or equinox batch)."""
    if isinstance(error, (NameError, ImportError)):
        return True
    if type(error).__name__ in _MODULE_CODE_ERRORS and "flax" in type(error).__module__:
        return True
    if not isinstance(error, AttributeError):
        return False
    owner = getattr(error, "obj", None)  # set by Python, not by flax's own AttributeError
    if owner is None:
        return bool(_MODULE_ATTRIBUTE.match(str(error)))
    arrays = (np.ndarray, np.generic, jax.Array)  # x's own containers are x's node types
    return not isinstance(owner, arrays) and type(owner) not in _node_types(x)


def _node_types(tree: Any) -> set[type]:
    """The types of `tree`'s pytree nodes (its containers), nested ones included."""
    found: set[type] = set()
    pending: list[Any] = [jax.tree_util.tree_structure(tree)]  # this jaxlib has no stub for it
    while pending:
        node = pending.pop()
        data = node.node_data()
        if data is not None:
            found.add(data[0])
        pending.extend(node.children())
    return found


# The libraries whose exceptions fuseloop reads as a shape's doing (JAX's and numpy's
# TypeError and ValueError of a misfit, flax's ScopeParamShapeError, ...).
_SHAPE_ERROR_LIBRARIES = frozenset({"builtins", "jax", "jaxlib", "flax", "numpy", "equinox"})


def _says_nothing_of_shapes(error: BaseException) -> bool:
    """A RuntimeError (NotImplementedError among them), or an exception class of the
    user's or of another library (einops's, about shapes, is one): by its type, it may or
    may not be about x's shape."""
    if isinstance(error, RuntimeError):
        return True
    return type(error).__module__.split(".")[0] not in _SHAPE_ERROR_LIBRARIES


# JAX's errors for a traced value read as a Python one (`if` on an array, `int()` of one).
_TRACED_AS_PYTHON = (
    jax.errors.ConcretizationTypeError,  # TracerBoolConversionError among them
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)

# How the note of an error kept as the model raised it begins.
KEPT = "fuseloop: the model raised this while"


def raise_from(problem: BaseException, error: BaseException) -> NoReturn:
    """Raises `problem` from `error`, or `error` itself (kept as the model raised it: its own
    cause and context stay)."""
    if problem is error:
        raise error
    raise problem from error


def kept_as_raised(error: BaseException, doing: str) -> BaseException | None:
    """`error` itself, noted with what fuseloop was `doing`, for an error of a kind that
    says nothing of x's shape by its type (a RuntimeError, a NotImplementedError, an
    exception class of the user's or of another library, whose message may): fuseloop
    cannot tell whether x is its cause, so it neither blames x nor changes the error's
    type. None for other errors."""
    if not _says_nothing_of_shapes(error):
        return None
    error.add_note(
        f"{KEPT} {doing}; if it is about x, give x the shape the model expects (the batch "
        f"axis first)"
    )
    return error


def model_code_error(error: BaseException, doing: str, x: Any = None) -> ValueError | None:
    """The ValueError for an error in the model's own code met while `doing` (so not
    blamed on x's shape, `x` the batch's x); None for other errors.

    Example:
        >>> error = model_code_error(NameError("name 'scale' is not defined"), "applying it")
        >>> str(error).startswith("model: applying it fails with NameError: name 'scale'")
        True
        >>> model_code_error(TypeError("dot_general requires contracting dims"), "applying it")
    """
    if "static_argnums" in str(error):  # jax.checkpoint's or nn.remat's, of positions
        return ValueError(
            f"model: {doing} fails with {first_line(error)}: the model is wrapped with "
            f"static_argnums (jax.checkpoint, nn.remat), which count positions. fuseloop "
            f"passes x, then a train flag and a key where the signature names them, by "
            f"position as far as the last flag, the rest by keyword: check static_argnums "
            f"against the signature"
        )
    if isinstance(error, _TRACED_AS_PYTHON):
        return ValueError(
            f"model: {doing} fails with {first_line(error)}: the model reads a traced "
            f"value as a Python one (an `if` on an array, int() or np.asarray of one), which "
            f"no shape of x avoids. Where it is a flag reaching a jax.jit, mark the flag "
            f"static (jax.jit(apply, static_argnames=('<the flag>',))); where it is a number "
            f"held in the batch, keep it out of the batch (close over it); where numpy reads "
            f"an array, use jax.numpy; else use jnp.where or jax.lax.cond"
        )
    if not _in_model_code(error, x):
        return None
    return ValueError(
        f"model: {doing} fails with {first_line(error)}, an error in the model's own code "
        f"that no shape of x would avoid (the traceback above shows where). Fix the model "
        f"and run again"
    )


def model_error(error: BaseException, doing: str, x: Any = None) -> BaseException | None:
    """`model_code_error`'s ValueError, else `kept_as_raised`'s error, else None."""
    return model_code_error(error, doing, x) or kept_as_raised(error, doing)
