"""What the public functions accept, judged in one place: an integer (a Python or numpy
integer, never a bool: `True` is no count of epochs; numpy's bool is no `np.integer`), a
path (a non-empty str or os.PathLike), and a callable's signature (it must take the call
it will get: a handler's State, a metric's `(y_true, y_pred)`)."""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from pathlib import Path
from typing import Any, TypeGuard

import jax
import numpy as np

from ._warn import warn

__all__ = [
    "prediction_first",
    "require_room",
    "check_seed_bits",
    "concrete_deleted",
    "is_int",
    "refuse_deleted_arrays",
    "refuse_signature",
    "refuse_stateless_save",
    "user_path",
]


def is_int(value: Any) -> TypeGuard[int | np.integer[Any]]:
    """Whether `value` is an integer argument.

    Example:
        >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
        (True, True, False, False)
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*([None] * count))
    except TypeError:
        return False
    return True


def user_path(path: Any, argument: str = "path") -> Path:
    """`path` as a Path (`~` expanded), or a ValueError naming `argument` for anything else
    (None, a number, an empty string: which would be the current folder).

    Example:
        >>> user_path("runs/a").name
        'a'
        >>> user_path(None)
        Traceback (most recent call last):
        ...
        ValueError: path=None must be a path: a str or a pathlib.Path
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{argument}={path!r} must be a path: a str or a pathlib.Path")
    return Path(path).expanduser()


def refuse_signature(fn: Any, argument: str, form: str) -> None:
    """Raises a ValueError where `fn`'s signature cannot take the call `form` shows (e.g.
    "handler(state)"): refused when it is attached, not when first called (after hours of
    training, maybe). A class given for its instance is named; a callable without a
    readable signature is let be. A handler written as a Keras callback method,
    `(epoch, logs=None)`, is refused; a loss or metric naming the prediction first
    (optax's `(logits, labels)` order) is warned about, once per function.

    Example:
        >>> refuse_signature(lambda y_true, y_pred: 0, "metric", "metric(y_true, y_pred)")
        >>> refuse_signature(lambda y: 0, "metric", "metric(y_true, y_pred)")
        Traceback (most recent call last):
        ...
        ValueError: metric=<lambda>(y) cannot be called as metric(y_true, y_pred) ...
    """
    count = form.count(",") + 1
    try:
        signature = inspect.signature(fn)
        wrapper = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*([None] * count))
    except TypeError as error:
        # A decorator's wrapper (functools.wraps) may take other arguments than the
        # function it wraps: it is what is called.
        if _binds(wrapper, count):
            return
        name = getattr(fn, "__name__", type(fn).__name__)
        fix = (
            f"{name} is a class: pass an instance, {name}(...)"
            if inspect.isclass(fn)
            else f"Give it {count} positional parameter{'s' if count > 1 else ''}: def {form}: ..."
        )
        raise ValueError(
            f"{argument}={name}{signature} cannot be called as {form} ({error}). {fix}"
        ) from None
    first, *rest = [*signature.parameters, None]
    optax_own = str(getattr(fn, "__module__", None)).startswith("optax")  # refused there
    named = form.endswith("(y_true, y_pred)") and prediction_first([first, *rest])
    if named and not optax_own and _first_time(fn):  # once: a loss is read again at the run
        warn(  # optax's order, (logits, labels): a loss or metric reading them swapped
            f"{argument} {getattr(fn, '__name__', type(fn).__name__)}{signature}: fuseloop "
            f"calls {form}, and its first parameter, {first!r}, is named for the prediction: "
            f"swap them if it reads them as optax's losses do, (logits, labels)"
        )
    if form.endswith("(state)") and first in ("epoch", "batch") and "logs" in signature.parameters:
        raise ValueError(  # Keras's on_epoch_end(epoch, logs=None): it would get the State
            f"{argument}={getattr(fn, '__name__', type(fn).__name__)}{signature} is a Keras "
            f"callback's method; a fuseloop handler gets one State: def {form}: ... with "
            f"state.epoch, state.iteration and state.metrics (Keras's logs)"
        )


_WARNED_ORDER: dict[int, Any] = {}  # id -> a weak reference to the function warned about
_PREDICTED = {"pred", "preds", "predicted", "prediction", "predictions", "logit", "logits"}
_PREDICTED |= {"output", "outputs", "score", "scores", "hat"}
_TARGET = {"true", "truth", "target", "targets", "label", "labels", "gold", "expected"}


def _first_time(fn: Any) -> bool:
    """Whether `fn` is warned about for the first time (one that takes no weak reference:
    every time)."""
    key = id(fn)
    ref = _WARNED_ORDER.get(key)
    if ref is not None and ref() is fn:
        return False

    def forget(_: Any) -> None:
        _WARNED_ORDER.pop(key, None)

    with contextlib.suppress(TypeError):
        _WARNED_ORDER[key] = weakref.ref(fn, forget)
    return True


def prediction_first(names: list[Any]) -> bool:
    """Whether parameters `names` read (prediction, target): the first named for the
    prediction (`y_pred`, `logits`), the second not (optax's losses take (logits, labels))."""

    def predicted(name: Any) -> bool:
        words = set(name.lower().replace("-", "_").split("_")) if isinstance(name, str) else set()
        return bool(words & _PREDICTED) and not words & _TARGET

    return len(names) >= 2 and predicted(names[0]) and not predicted(names[1])


def refuse_deleted_arrays(tree: Any, argument: str) -> None:
    """Raises a RuntimeError (as JAX's own) where a device array of `tree` was deleted:
    most often a State (or its params) kept from inside a run, whose buffers the run's
    next chunk reused (donated). JAX would say only "Array has been deleted", from deep
    inside the call.

    Example:
        >>> a = jax.numpy.ones(2)
        >>> a.delete()
        >>> refuse_deleted_arrays({"w": a}, "init_state")
        Traceback (most recent call last):
        ...
        RuntimeError: init_state holds arrays that were deleted: ...
    """
    if not holds_deleted_arrays(tree):
        return
    raise RuntimeError(
        f"{argument} holds arrays that were deleted: a State a handler kept from inside a "
        f"run shares the arrays the run's next steps reuse (donate), so they are gone once "
        f"the run moves on (or they were deleted or donated elsewhere, as the step state of "
        f"an error's fuseloop_state after a step failed on the device). Keep a copy in the "
        f"handler, jax.tree.map(jnp.copy, state.step_state) or jax.tree.map(jnp.copy, "
        f"state.params), or use the State the run returns"
    )


def holds_deleted_arrays(tree: Any) -> bool:
    """Whether `tree`'s first device array was deleted (a donated carry is deleted whole,
    so its first array tells; a check per leaf costs about a microsecond each, at every
    resume). Traced values are not arrays that can be deleted."""
    first = next((a for a in jax.tree.leaves(tree) if _concrete_array(a)), None)
    return first is not None and first.is_deleted()


def concrete_deleted(leaf: Any) -> bool:
    """Whether `leaf` is a device array that was deleted (a traced value is not)."""
    return _concrete_array(leaf) and leaf.is_deleted()


def _concrete_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def check_seed_bits(seed: int) -> None:
    """A ValueError where, without x64, JAX would key `seed` by its low 32 bits alone (a
    trainer is checked when built and when its run starts, x64 may change in between)."""
    if not jax.config.read("jax_enable_x64") and not -(2**31) <= seed < 2**32:
        raise ValueError(
            f"seed={seed} is outside [-2**31, 2**32): without jax_enable_x64, JAX makes a "
            f"key from a seed's low 32 bits, so it would train exactly as "
            f"seed={seed % 2**32}; pass a seed in that range (e.g. seed % 2**32)"
        )


def require_room(path: Path, given: str, wanted: str, noun: str | None = None) -> None:
    """Raises a ValueError, when a handler is attached, where no `wanted` can be made.

    `wanted` is "file" or "directory" (`noun` names it in the message, e.g. "checkpoint
    directory"); `given` is the argument as the user wrote it (`path='runs/x'`). What is
    refused is a folder where a file goes, or a file on the way.
    """
    if wanted == "file" and path.is_dir():
        raise ValueError(
            f"{given} is a directory; give a file path, e.g. {str(path / 'metrics.csv')!r}"
        )
    taken = next((p for p in (path, *path.parents) if p.exists()), None)  # nearest existing
    if taken is not None and not taken.is_dir() and (wanted == "directory" or taken != path):
        raise ValueError(
            f"{given}: {str(taken)!r} is a file, so no {noun or wanted} can be made there; "
            f"give a {wanted} path"
        )


def refuse_stateless_save(state: Any) -> None:
    """Raises a ValueError for a State without a step state given to a save: no run could
    resume from it, and a handler saving one would only learn so at the resume.

    Example:
        >>> import fuseloop as fl
        >>> refuse_stateless_save(fl.State(step_state={"w": 1.0}))
        >>> refuse_stateless_save(fl.State(epoch=3))
        Traceback (most recent call last):
        ...
        ValueError: state: this State holds no step state, so no run could resume from ...
    """
    if getattr(state, "step_state", None) is not None:
        return
    raise ValueError(
        "state: this State holds no step state, so no run could resume from its save. "
        "Inside a run, an observer (Loop.observe) replayed after a dispatch of several "
        "epochs (fuse='run', or a chunk across an epoch's end) and an iteration handler "
        "of a fused run are given a State without it: save at 'epoch_completed' from a "
        "handler attached with Loop.handle_event (a dispatch ends at each epoch it fires "
        "in), or attach Loop.checkpoint(path), which saves there itself"
    )
