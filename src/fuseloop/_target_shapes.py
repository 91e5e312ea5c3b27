"""A user's loss or metric function, called with the targets and outputs as they are.

A hand-written optax loop hands `loss(y_true, y_pred)` the batch's targets and the model's
output as they come, so that is what fuseloop hands a user's function. Keras instead makes
them one rank first ((B,) targets against a (B, 1) output become (B, 1) and (B, 1)); either
convention silently breaks code written for the other: `y_pred - y_true` broadcasts (B,)
against (B, 1) to (B, B), and `y_pred[:, 0] - y_true` does the same once Keras has expanded
the targets. So where the two shapes broadcast to a cross product (larger than both, e.g.
(B, B)), the function is traced once on those shapes, and if it builds an array of that
cross shape the run stops with an error that names the fix (docs/design.md §5). Pytrees of
targets and outputs (a multi-output model's dicts) are checked leaf by leaf, pairing the
leaves that sit at the same place in both.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["refusing_cross_broadcast"]

Shape = tuple[int, ...]


def refusing_cross_broadcast(fn: Callable[..., Any], kind: str, name: str) -> Callable[..., Any]:
    """`fn(y_true, y_pred)` as given, refused where it broadcasts every target against every
    prediction (`kind`: "loss" or "metric", `name`: its name, for the message).

    Example:
        >>> import numpy as np
        >>> per_example = refusing_cross_broadcast(lambda t, p: p[:, 0] - t, "loss", "l")
        >>> per_example(np.zeros(4), np.zeros((4, 1))).shape
        (4,)
        >>> crossed = refusing_cross_broadcast(lambda t, p: p - t, "loss", "l")
        >>> crossed(np.zeros(4), np.zeros((4, 1)))
        Traceback (most recent call last):
        ...
        ValueError: the loss l(y_true, y_pred) got y_true of shape (4,) and y_pred of ...
    """
    _refuse_optax_order(fn, kind)
    checked: set[Any] = set()

    @functools.wraps(fn)
    def called(y_true: Any, y_pred: Any) -> Any:
        key = _signature(y_true, y_pred)
        if key is not None and key not in checked:
            _refuse_cross(fn, y_true, y_pred, kind, name)
            checked.add(key)
        return fn(y_true, y_pred)

    return called


def _signature(y_true: Any, y_pred: Any) -> Any:
    """The structures, shapes and dtypes of the targets and outputs (None where a leaf is
    not an array)."""
    described = []
    for tree in (y_true, y_pred):
        leaves, structure = jax.tree.flatten(tree)
        if not leaves or any(getattr(leaf, "shape", None) is None for leaf in leaves):
            return None
        described.append((structure, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)))
    return tuple(described)


def _crossed_pairs(y_true: Any, y_pred: Any) -> list[tuple[str, Shape, Shape, Shape]]:
    """`(where, target shape, output shape, cross shape)` for each target and output at the
    same place in both trees whose shapes broadcast to one larger than either."""
    outputs = dict(jax.tree_util.tree_flatten_with_path(y_pred)[0])
    crossed = []
    for path, target in jax.tree_util.tree_flatten_with_path(y_true)[0]:
        output = outputs.get(path)
        if output is None:
            continue
        t, p = tuple(target.shape), tuple(output.shape)
        try:
            cross = tuple(np.broadcast_shapes(t, p))
        except ValueError:
            continue  # they do not broadcast: the function reshapes them, or raises itself
        if math.prod(cross) > max(math.prod(t), math.prod(p)):
            crossed.append((jax.tree_util.keystr(path), t, p, cross))
    return crossed


def _refuse_cross(fn: Callable[..., Any], y_true: Any, y_pred: Any, kind: str, name: str) -> None:
    crossed = _crossed_pairs(y_true, y_pred)
    if not crossed:
        return
    abstract = [
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
        for tree in (y_true, y_pred)
    ]
    try:
        traced = jax.make_jaxpr(fn)(*abstract)
    except Exception:  # noqa: BLE001 - the real call raises it, with the user's traceback
        return
    built = set(_shapes_built(traced.jaxpr))
    for where, t, p, cross in crossed:
        if cross in built:
            raise ValueError(
                f"the {kind} {name}(y_true, y_pred) got y_true{where} of shape {t} and "
                f"y_pred{where} of shape {p}, and it broadcasts them to {cross}: every "
                f"target against every prediction, which a {kind} rarely means. fuseloop "
                f"passes both as they are (as a hand-written optax loop does; Keras would "
                f"first make them one rank). Make them one shape inside the {kind} (e.g. "
                f"y_pred{where}[..., 0] or y_true{where}[..., None]), or in the model's "
                f"output or the data's y"
            )


def _shapes_built(jaxpr: Any) -> Iterator[Shape]:
    """The shapes of every array `jaxpr` builds, its inner programs' included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for inner in _inner_jaxprs(param):
                yield from _shapes_built(inner)


def _inner_jaxprs(param: Any) -> Iterator[Any]:
    """The programs an equation's parameter holds (a jit's, a cond's branches, ...)."""
    if hasattr(param, "eqns"):
        yield param
    elif hasattr(param, "jaxpr") and hasattr(param.jaxpr, "eqns"):
        yield param.jaxpr
    elif isinstance(param, (tuple, list)):
        for item in param:
            yield from _inner_jaxprs(item)


def _refuse_optax_order(fn: Any, kind: str) -> None:
    """An optax loss given as is: optax's losses take `(predictions, targets)` and return
    one value per example, where fuseloop calls `fn(y_true, y_pred)` for a scalar, so the
    arguments would be swapped (and a shape error, or a `.mean()` added after one, would
    hide it)."""
    module = str(getattr(fn, "__module__", "") or "")
    if module == "optax" or module.startswith("optax."):
        name = getattr(fn, "__name__", "the function")
        raise ValueError(
            f"{kind}=optax.{name}: optax's losses take (predictions, targets), while "
            f"fuseloop calls a {kind} as {kind}(y_true, y_pred). Wrap it: lambda y_true, "
            f"y_pred: optax.{name}(y_pred, y_true).mean(), or pass a built-in name such as "
            f"'sparse_categorical_cross_entropy'"
        )
