"""A user's loss or metric function, called with the targets and outputs as they are.

A hand-written optax loop hands `loss(y_true, y_pred)` the targets and outputs as they
come, and so does fuseloop; Keras makes them one rank first. Either convention silently
breaks code written for the other (`y_pred - y_true` of (B, 1) and (B,) is (B, B)), so the
function is traced on each new signature, and an operation that broadcasts a value computed
from a target against one computed from the outputs across examples stops the run with an
error that names the fix (docs/design.md §5). A pairwise loss whose (B, B) arrays come from
the targets or the outputs alone runs, as does one marked `fl.pairwise`; a cross found is
traced again at another batch size (a (B, T, T) distance where B is T is no cross). Leaves
sharing no batch axis: an array of their cross shape built from both is refused."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from ._optax_order import refuse_optax_order
from ._outputs_at import model_outputs_there
from ._pairwise import is_pairwise

__all__ = ["CrossBroadcastError", "refusing_cross_broadcast"]

Shape = tuple[int, ...]


class CrossBroadcastError(ValueError):
    """A loss or metric function broadcasts every target against every prediction; its
    message names the fixes, so it is raised as it is, not as y's misfit."""


_Built = dict[Shape, list[frozenset[int]]]  # a shape -> what each array of it reads


def refusing_cross_broadcast(fn: Callable[..., Any], kind: str, name: str) -> Callable[..., Any]:
    """`fn(y_true, y_pred)` as given, refused where it broadcasts every target against every
    prediction (`kind`: "loss" or "metric", `name`: its name, for the message).

    Example:
        >>> per_example = refusing_cross_broadcast(lambda t, p: p[:, 0] - t, "loss", "l")
        >>> per_example(np.zeros(4), np.zeros((4, 1))).shape
        (4,)
        >>> crossed = refusing_cross_broadcast(lambda t, p: p - t, "loss", "l")
        >>> crossed(np.zeros(4), np.zeros((4, 1)))
        Traceback (most recent call last):
        ...
        fuseloop._target_shapes.CrossBroadcastError: the loss l(y_true, y_pred) got y_true of ...
    """
    refuse_optax_order(fn, kind)
    if is_pairwise(fn):  # every target against every prediction, on purpose
        return fn
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
    """The targets' and outputs' structures, shapes and dtypes (None: a leaf is no array)."""
    described = []
    for tree in (y_true, y_pred):
        leaves, structure = jax.tree.flatten(tree)
        if not leaves or any(getattr(leaf, "shape", None) is None for leaf in leaves):
            return None
        described.append((structure, tuple((tuple(a.shape), str(a.dtype)) for a in leaves)))
    return tuple(described)


class _Crossed(NamedTuple):
    """A target and an output whose shapes broadcast to one larger than either."""

    target: int  # its leaf's index among the targets'
    output: int  # its leaf's index among the outputs'
    target_at: str  # its place in y_true ("" for a lone array), as keystr writes it
    output_at: str
    target_shape: Shape
    output_shape: Shape
    cross: Shape
    spread: bool = False  # by `_spread_over` alone: refused where it fails at another size


def _crossed_pairs(y_true: Any, y_pred: Any) -> list[_Crossed]:
    """Every target and output whose shapes broadcast to one larger than either."""
    outputs = jax.tree_util.tree_flatten_with_path(y_pred)[0]
    crossed = []
    for i, (t_path, target) in enumerate(jax.tree_util.tree_flatten_with_path(y_true)[0]):
        for j, (p_path, output) in enumerate(outputs):
            t, p = tuple(target.shape), tuple(output.shape)
            try:
                cross = tuple(np.broadcast_shapes(t, p))
            except ValueError:
                continue  # they do not broadcast: the function reshapes them, or raises
            if math.prod(cross) > max(math.prod(t), math.prod(p)):
                where = (jax.tree_util.keystr(t_path), jax.tree_util.keystr(p_path))
                crossed.append(_Crossed(i, j, *where, t, p, cross))
    return crossed


def _refuse_cross(fn: Callable[..., Any], y_true: Any, y_pred: Any, kind: str, name: str) -> None:
    """Where every leaf has one batch axis, the operations `fn` runs are read for one that
    broadcasts a target-derived value against an output-derived one across examples (a
    pairwise loss, whose (B, B) arrays each come from targets alone or outputs alone, runs);
    elsewhere, for an array of a crossed pair's cross shape built from both."""
    crossed = _crossed_pairs(y_true, y_pred)
    if (_shared_batch(jax.tree.leaves((y_true, y_pred))) or 0) < 2:  # none, or one example
        hits = _built_crosses(fn, y_true, y_pred, crossed)
        if hits and not _coincidental(fn, _at_another_size(y_true, y_pred)):
            raise CrossBroadcastError(_cross_message(hits[0], kind, name))
        return
    mixed = _mixed_crosses(fn, y_true, y_pred) or []
    crosses = [c for c in mixed if not c.spread]
    again = _at_another_size(y_true, y_pred) if mixed else None  # (traces the model)
    if crosses and _coincidental(fn, again, _mixed_crosses):
        crosses = []
    if not crosses and mixed and again is not None and _traced(fn, *again) is None:
        crosses = mixed  # spread over an axis as long as the batch, which fails elsewhere
    if crosses:
        found = crosses[0]
        # The target and the output themselves cross: make them one shape.
        leaves = next((c for c in crossed if c[:2] == found[:2]), None)
        raise CrossBroadcastError(
            _cross_message(leaves or found, kind, name, inside=leaves is None)
        )


def _mixed_crosses(fn: Callable[..., Any], y_true: Any, y_pred: Any) -> list[_Crossed] | None:
    """The crosses `fn` builds between a value computed from a target and one computed
    from the outputs: `y_pred - y_true` of (B, 1) and (B,), or, inside, `weight *
    per_example` with weights of (B, 1) and a per-example loss of (B,), though no target
    leaf crosses an output leaf. None where `fn` cannot be traced on these shapes."""
    traced = _traced(fn, y_true, y_pred)
    if traced is None:
        return None
    targets = jax.tree_util.tree_flatten_with_path(y_true)[0]
    outputs = jax.tree_util.tree_flatten_with_path(y_pred)[0]
    leaves = [leaf for _, leaf in targets + outputs]
    batch = _shared_batch(leaves)
    if batch is None or batch < 2:
        return []  # no batch axis shared by every leaf, or one example: nothing to cross
    # A scalar crosses nothing: an operand that reads one is named by its other leaves.
    sources = [frozenset([k] if leaves[k].shape else []) for k in range(len(leaves))]
    found: list[_Crossed] = []
    for i, j, cross, spread in _broadcasts_between(traced.jaxpr, sources, len(targets), batch, {}):
        (t_path, target), (p_path, output) = targets[i], outputs[j]
        where = (jax.tree_util.keystr(t_path), jax.tree_util.keystr(p_path))
        shapes = (tuple(target.shape), tuple(output.shape), cross)
        found.append(_Crossed(i, j, *where, *shapes, spread))
    return found


def _broadcasts_between(
    jaxpr: Any, sources: list[frozenset[int]], n_targets: int, batch: int, spread: dict[Any, Shape]
) -> Iterator[tuple[int, int, Shape, bool]]:
    """`(target, output, shape, spread)` for each elementwise operation of `jaxpr` that broadcasts
    an operand reading target `target` against another reading output `output` across
    examples: each holds `batch` on an axis where the other holds 1 (a (B, T, T) distance
    between time steps shares its batch axis, and is not one). Inner programs included.
    `spread`: an array made by `broadcast_in_dim` -> the shape it was made from, in the
    result's rank (`jnp.where` broadcasts its operands so before one `select_n`)."""
    reads: dict[Any, frozenset[int]] = dict(zip(jaxpr.invars, sources, strict=True))
    for eqn in jaxpr.eqns:
        operands = [
            (reads.get(v, frozenset()), spread.get(v, _shape(v)))
            for v in eqn.invars
            if not hasattr(v, "val")
        ]
        read = frozenset().union(*(r for r, _ in operands))
        for var in eqn.outvars:
            reads[var] = read
        out = _shape(eqn.outvars[0]) if eqn.outvars else ()
        if eqn.primitive.name == "broadcast_in_dim" and len(operands) == 1:
            spread[eqn.outvars[0]] = _spread(operands[0][1], eqn.params, out)
        shapes = [shape for _, shape in operands]
        if (
            len(shapes) > 1
            and all(_fits(shape, out) for shape in shapes)
            and shapes != [out] * len(shapes)
        ):
            for a, b in ((a, b) for a in operands for b in operands if a is not b):
                target = min((k for k in a[0] if k < n_targets), default=None)
                output = min((k for k in b[0] if k >= n_targets), default=None)
                if target is None or output is None:
                    continue
                across = _across(a[1], b[1], batch)
                if across or _spread_over(a[1], b[1], batch):
                    yield target, output - n_targets, out, not across
                    break
        for param in eqn.params.values():
            for inner in _inner_jaxprs(param):
                # An inner program (a jit's) takes the operands in order; others (a cond's
                # branches, a loop's body) are taken as reading all of them.
                given = [r for r, _ in operands] if len(inner.invars) == len(operands) else None
                inner_sources = given or [read] * len(inner.invars)
                yield from _broadcasts_between(inner, inner_sources, n_targets, batch, {})


def _spread(shape: Shape, params: Any, out: Shape) -> Shape:
    """The shape `broadcast_in_dim` (with `params`) spread to `out`, in `out`'s rank: 1 on
    every axis it added or stretched from 1."""
    spread = [1] * len(out)
    for axis, size in zip(params["broadcast_dimensions"], shape, strict=True):
        spread[axis] = size
    return tuple(spread)


def _shared_batch(leaves: list[Any]) -> int | None:
    """The leading axis of every leaf but a scalar or a (1,) (crossing nothing); or None."""
    sizes = {leaf.shape[0] for leaf in leaves if len(leaf.shape)}
    sizes = sizes - {1} if len(sizes) == 2 else sizes  # a (1,) regulariser beside (B, ...)
    return int(sizes.pop()) if len(sizes) == 1 else None


def _across(a: Shape, b: Shape, batch: int) -> bool:
    """Whether `a` and `b` each hold `batch` on an axis where the other holds 1."""
    pairs = list(zip(a, b, strict=True))
    return (batch, 1) in pairs and (1, batch) in pairs


def _spread_over(a: Shape, b: Shape, batch: int) -> bool:
    """Whether `a` holds 1 on the examples' (first) axis where `b` holds `batch`, and
    `batch` on a later one where `b` does too: (B,) targets spread over a (B, H) output
    whose H is B (at another batch size they would not broadcast), or a pairwise term
    weighed by a row of the targets' (they would: `_refuse_cross` traces both there)."""
    pairs = list(zip(a, b, strict=True))
    return bool(pairs) and pairs[0] == (1, batch) and (batch, batch) in pairs[1:]


def _traced(fn: Callable[..., Any], y_true: Any, y_pred: Any) -> Any:
    """`fn`'s jaxpr on the shapes and dtypes of `y_true` and `y_pred` (None where it cannot
    be traced on them: the real call raises that, with the user's traceback)."""
    abstract = [
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
        for tree in (y_true, y_pred)
    ]
    try:
        return jax.make_jaxpr(fn)(*abstract)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _shape(var: Any) -> Shape:
    return tuple(getattr(getattr(var, "aval", None), "shape", ()))


def _fits(shape: Shape, out: Shape) -> bool:
    """Whether `shape` is an elementwise operand of an operation making `out` (every axis
    the same or 1; a contraction's operands are not)."""
    return len(shape) == len(out) and all(d in (1, o) for d, o in zip(shape, out, strict=True))


def _built_crosses(
    fn: Callable[..., Any], y_true: Any, y_pred: Any, crossed: list[_Crossed], always: bool = False
) -> list[_Crossed] | None:
    """The pairs of `crossed` whose cross shape `fn` builds by an operation reading both
    (an array of that shape built from the outputs alone, a (B, B) similarity matrix, say,
    crosses no target with them); None where `fn` cannot be traced on these shapes (traced
    only where some pair crosses, unless `always`)."""
    if not crossed and not always:
        return []
    traced = _traced(fn, y_true, y_pred)
    if traced is None:
        return None
    n_targets = len(jax.tree.leaves(y_true))
    sources = [frozenset([k]) for k in range(len(traced.jaxpr.invars))]
    built = _built_from(traced.jaxpr, sources)
    return [
        pair
        for pair in crossed
        if any({pair.target, n_targets + pair.output} <= read for read in built.get(pair.cross, []))
    ]


def _at_another_size(y_true: Any, y_pred: Any) -> tuple[Any, Any] | None:
    """The targets and outputs, abstract, at a batch size unlike any other axis, or None."""
    leaves = jax.tree.leaves((y_true, y_pred))
    if (batch := _shared_batch(leaves)) is None:
        return None
    other = 2 + max(max(leaf.shape, default=0) for leaf in leaves)

    def resized(tree: Any) -> Any:  # a scalar, or a (1,) beside the batch, stays as it is
        new = lambda a: (other, *a.shape[1:]) if a.shape[:1] == (batch,) else a.shape  # noqa: E731
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(new(a), a.dtype), tree)

    made = model_outputs_there(batch, other, y_pred)  # the model's own, where the step knows them
    return resized(y_true), made if made is not None else resized(y_pred)


def _coincidental(
    fn: Callable[..., Any], again: tuple[Any, Any] | None, finder: Callable[..., Any] | None = None
) -> bool:
    """Whether the crosses found are a coincidence of this batch's size: traced again with
    a batch size unlike any other axis (`again`, `_at_another_size`'s targets and outputs;
    None where there is none), the function builds none (a function that fixes
    its batch size, by an array it closes over, cannot be asked). (B, T) targets against a
    (B, T, 1) output broadcast to (B, B, T) where B is 1 or T, the shape a (B, T, T)
    distance between time steps has; a true cross, `y_pred - y_true` of (B,) against
    (B, 1), builds one at every batch size.)"""
    if again is None:
        return False
    if finder is not None and _shared_batch(jax.tree.leaves(again)) is not None:
        return finder(fn, *again) == []  # `_mixed_crosses`
    # (the model's own outputs there may share no batch axis with the targets, as a
    # (K, D) output beside a per-example one: the older rule judges)
    crossed = _crossed_pairs(*again)
    # A function that fails at the other size (`y_pred - y_true` of (1, T, 1) and (1, T),
    # a cross at B = 1 only) is judged by the batch it was given.
    return _built_crosses(fn, *again, crossed, always=True) == []


def _cross_message(pair: _Crossed, kind: str, name: str, inside: bool = False) -> str:
    t, p = f"y_true{pair.target_at}", f"y_pred{pair.output_at}"
    if inside and pair.cross == pair.output_shape:  # (B,) targets spread over (B, B)
        return (
            f"the {kind} {name}(y_true, y_pred) got {t} of shape {pair.target_shape} and {p} "
            f"of shape {pair.output_shape}, and it broadcasts {t}'s examples along an axis "
            f"of {p} that holds as many values as the batch: every target against every "
            f"prediction. If that axis holds classes or outputs that only number the batch "
            f"size here (at another batch size they would not broadcast), give each "
            f"example's target its own axis inside the {kind} (e.g. {t}[..., None], against "
            f"each of that example's outputs), or make the model output one value per "
            f"example. If {p} holds a score for every pair of examples (a retrieval score, "
            f"an in-batch softmax), pass fl.pairwise({name}) instead"
        )
    them = f"a value computed from {t} against one computed from {p}" if inside else "them"
    fix = (
        f"(e.g. {t}[..., 0] where it holds one value per example in a column, as Keras "
        f"reshapes a sample_weight)"
        if inside
        else f"(e.g. {t}[..., 0] or {p}[..., None])"
        if pair.target_shape[-1:] == (1,) and pair.output_shape[-1:] != (1,)
        else f"(e.g. {p}[..., 0] or {t}[..., None])"
    )
    return (
        f"the {kind} {name}(y_true, y_pred) got {t} of shape {pair.target_shape} and "
        f"{p} of shape {pair.output_shape}, and it broadcasts {them} to {pair.cross}: every "
        f"target against every prediction, which a {kind} rarely means. fuseloop passes "
        f"both as they are (as a hand-written optax loop does; Keras would first make them "
        f"one rank). Make them one shape inside the {kind} {fix}, or in the model's output "
        f"or the data's y. If every target against every prediction is meant (a retrieval "
        f"score, a contrastive {kind}), pass fl.pairwise({name}) instead"
    )


def _built_from(jaxpr: Any, sources: list[frozenset[int]], built: _Built | None = None) -> _Built:
    """Each shape of an array `jaxpr` builds (its inner programs' included) -> for each
    operation building one, the inputs of the function it reads (through everything before
    it). `sources`: what each of `jaxpr`'s inputs reads."""
    built = {} if built is None else built
    reads: dict[Any, frozenset[int]] = dict(zip(jaxpr.invars, sources, strict=True))
    for eqn in jaxpr.eqns:
        # A literal (a constant written into the program) reads no input, nor does an
        # array the function closes over (one of the jaxpr's constants).
        read = frozenset().union(
            *(reads.get(v, frozenset()) for v in eqn.invars if not hasattr(v, "val"))
        )
        for var in eqn.outvars:
            reads[var] = read
            built.setdefault(tuple(getattr(var.aval, "shape", ())), []).append(read)
        for param in eqn.params.values():
            for inner in _inner_jaxprs(param):
                # An inner program (a jit's, a cond's branch, ...) is taken as reading all of
                # the operation's inputs: it builds from them, whatever it picks.
                _built_from(inner, [read] * len(inner.invars), built)
    return built


def _inner_jaxprs(param: Any) -> Iterator[Any]:
    """The programs an equation's parameter holds (a jit's, a cond's branches, ...)."""
    if hasattr(param, "eqns"):
        yield param
    elif hasattr(param, "jaxpr") and hasattr(param.jaxpr, "eqns"):
        yield param.jaxpr
    elif isinstance(param, (tuple, list)):
        for item in param:
            yield from _inner_jaxprs(item)
