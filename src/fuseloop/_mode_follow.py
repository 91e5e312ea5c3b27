"""A flag of an nnx or equinox module's `__call__` that fuseloop does not pass, found
setting its Dropout or BatchNorm out of the mode fuseloop runs it in.

fuseloop switches an nnx module with `.train()`/`.eval()` and an equinox one with
`eqx.nn.inference_mode`, and passes the flags it recognises (`TRAIN_FLAGS`) by name. A flag
of another name (`is_train`, `use_dropout`) stays at its default; when the call hands it on
to a layer (`deterministic=not is_train`), the layer does what the default says in training
and in evaluation alike: a silently different model. So, while a module that takes such a
flag is traced, the mode each Dropout, BatchNorm and attention layer runs in is recorded.
Only where one runs out of the mode is each such flag flipped, in an abstract call, to see
whether it is what set that layer: a layer held out of the mode on purpose (a BatchNorm
frozen for fine-tuning), or one only another value of the flag would call, is the user's
choice. A compiled step pays nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ._linen import NNX_MODE_FLAGS, TRAIN_FLAGS, ModelModeError

__all__ = ["run_following_modes", "unrecognised_flags"]

# A layer's own mode arguments, each True in evaluation (False while training).
_LAYER_FLAGS = ("deterministic", "use_running_average", "inference")
# One recording at a time patches the layer classes' `__call__` (trace time only).
_PATCHING = threading.RLock()
_RECORDS = threading.local()


def unrecognised_flags(module: Any) -> dict[str, bool]:
    """Each parameter of `module`'s `__call__` after x with a bool default that is not a
    flag fuseloop passes (`TRAIN_FLAGS`), with that default.

    Example:
        >>> class Net:
        ...     def __call__(self, x, is_train: bool = False, train: bool = False): ...
        >>> unrecognised_flags(Net())
        {'is_train': False}
    """
    try:
        parameters = list(inspect.signature(type(module).__call__).parameters.values())[2:]
    except (TypeError, ValueError):
        return {}
    return {
        p.name: p.default
        for p in parameters
        if isinstance(p.default, bool) and p.name not in TRAIN_FLAGS
    }


def run_following_modes(
    root: Any,
    call: Callable[[], Any],
    fresh: Callable[[], tuple[Any, Callable[[dict[str, bool]], Any]]],
    flags: dict[str, bool],
    train: bool,
) -> Any:
    """`call()`, the call of the module `root`, refused with a ModelModeError where one of
    `flags` (unrecognised, at their defaults) set a layer out of `train`'s mode.

    `fresh()` gives `(a module like root, a call of it with extra keyword arguments)` for
    the abstract calls with a flag flipped (an nnx module changes as it is called).
    """
    if not flags:
        return call()
    with _recording(root) as seen:
        out = call()
    wrong = {where: mode for where, mode in seen.items() if any(v != (not train) for v in mode)}
    # Each flag flipped alone, then all together (a layer set by `is_train and use_dropout`).
    flips = [{name: not default} for name, default in flags.items()] if wrong else []
    flips += [{name: not default for name, default in flags.items()}] if len(flips) > 1 else []
    for flipped in flips:
        other: dict[tuple[str, str], list[bool]] = {}
        try:  # traced abstractly, the module made inside (nnx: at the trace's level)
            jax.eval_shape(functools.partial(_flipped, fresh, flipped, other))
        except Exception:  # noqa: BLE001 - cannot tell what the flag sets: not refused
            continue
        # The modes a layer runs in, not how often it runs (a flag calling it twice).
        set_by_flag = [w for w in wrong if w in other and set(other[w]) != set(wrong[w])]
        if set_by_flag:
            layers = {w: [v for v in wrong[w] if v != (not train)] for w in set_by_flag}
            defaults = {name: not value for name, value in flipped.items()}
            raise _refusal(root, defaults, layers, train)
    return out


def _flipped(fresh: Callable[[], Any], extra: dict[str, bool], seen: dict[Any, Any]) -> Any:
    """A fresh module's call with `extra` flags, its layers' modes recorded into `seen`."""
    root, call = fresh()
    with _recording(root) as recorded:
        out = call(extra)
    seen.update(recorded)
    return out


def _refusal(
    root: Any, defaults: dict[str, bool], layers: dict[tuple[str, str], list[bool]], train: bool
) -> ModelModeError:
    """The ModelModeError for `layers` set out of `train`'s mode by flags at `defaults`."""
    said = "; ".join(
        f"{where} runs with {flag}={mode[0]}" for (where, flag), mode in layers.items()
    )
    given = ", ".join(f"{name}={value}" for name, value in defaults.items())
    flipped = ", ".join(f"{name}={not value}" for name, value in defaults.items())
    return ModelModeError(
        f"model: {type(root).__name__}.__call__ takes {given}, not a flag fuseloop passes, "
        f"and at that default it sets layers out of {'training' if train else 'evaluation'}: "
        f"{said} ({flipped} switches them). Name the flag one fuseloop passes "
        f"({', '.join(NNX_MODE_FLAGS)}: e.g. `def __call__(self, x, train: bool = False)`), "
        f"or let the layers follow the mode fuseloop sets (.train()/.eval(), "
        f"eqx.nn.inference_mode) by not passing them one; to hold a layer out of it on "
        f"purpose (a frozen BatchNorm), pass its mode as a constant in the call "
        f"(use_running_average=True), not through a flag"
    )


@contextlib.contextmanager
def _recording(root: Any) -> Iterator[dict[tuple[str, str], list[bool]]]:
    """Records, for each call on this thread of a Dropout, BatchNorm or attention layer
    of `root`, the mode it runs in: `{(layer, its flag): [True in evaluation, ...]}`."""
    paths, seen = _layer_paths(root), dict[tuple[str, str], list[bool]]()
    with _PATCHING:
        originals = {cls: cls.__dict__["__call__"] for cls in _layer_classes()}
        outer = getattr(_RECORDS, "active", None)
        _RECORDS.active = (threading.get_ident(), paths, seen)
        for cls, original in originals.items():
            cls.__call__ = _recorder(original)  # type: ignore[method-assign]
        try:
            yield seen
        finally:
            for cls, original in originals.items():
                cls.__call__ = original  # type: ignore[method-assign]
            _RECORDS.active = outer


def _recorder(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def recording(layer: Any, *args: Any, **kwargs: Any) -> Any:
        active = getattr(_RECORDS, "active", None)
        if active is not None and active[0] == threading.get_ident() and _drops(layer):
            try:
                given = signature.bind(layer, *args, **kwargs).arguments
            except TypeError:  # the call below raises Python's own error for it
                return original(layer, *args, **kwargs)
            for flag in _LAYER_FLAGS:
                value = given.get(flag)
                value = getattr(layer, flag, None) if value is None else value
                where = f"{type(layer).__name__} {active[1].get(id(layer), '?')}"
                if isinstance(value, bool) and (flag in given or hasattr(layer, flag)):
                    active[2].setdefault((where, flag), []).append(value)
        return original(layer, *args, **kwargs)

    recording.__wrapped__ = original  # type: ignore[attr-defined]
    return recording


def _drops(layer: Any) -> bool:
    """Whether the layer's mode changes what it computes (a Dropout of rate 0 does not)."""
    rate = getattr(layer, "rate", getattr(layer, "p", getattr(layer, "dropout_rate", None)))
    return rate is None or bool(rate)


def _layer_classes() -> list[type]:
    """The layer classes whose mode is recorded, of the libraries imported."""
    classes: list[type] = []
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
        classes += [nnx.Dropout, nnx.BatchNorm, nnx.MultiHeadAttention]
    eqx = sys.modules.get("equinox")
    if eqx is not None:
        classes += [eqx.nn.Dropout]  # eqx.nn.MultiheadAttention calls one
    return classes


def _layer_paths(root: Any) -> dict[int, str]:
    """`id(layer) -> its path in root` for every submodule of an nnx or equinox `root`."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(root, nnx.Module):
        return {id(node): ".".join(map(str, path)) for path, node in nnx.iter_graph(root)}
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return {}
    found = jax.tree_util.tree_flatten_with_path(
        root, is_leaf=lambda node: isinstance(node, eqx.nn.Dropout)
    )[0]
    return {id(node): jax.tree_util.keystr(path).lstrip(".") for path, node in found}
