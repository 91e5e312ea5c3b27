"""Weakly typed leaves of a run's initial step state (docs/design.md §2).

A leaf made from a Python number (`{"k": 1.0}`, `jnp.array(1.0)`) is weakly typed: beside
a float32 array under x64, or a bfloat16 one, it takes the array's dtype, while the
strongly typed array an optimizer's update returns for it keeps its own. A plain loop's
first step then computes in the narrower dtype and its later steps in the leaf's, and a
device loop carrying the leaf would compute every step as the first. Such a leaf, which
the step makes strongly typed, is made the array the step returns (its dtype) before the
first step, fused or not: every step computes as the plain loop's second does. A leaf the
step keeps weakly typed (a counter `n + 1`) stays as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

__all__ = ["strengthen_weak_leaves"]


def _weak(leaf: Any) -> bool:
    """A weakly typed array, or a Python number (jit takes it weakly typed; not a bool)."""
    plain = isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)
    return plain or bool(getattr(leaf, "weak_type", False))


def _shape_and_dtype(leaf: Any) -> tuple[Any, Any]:
    return np.shape(leaf), jax.numpy.result_type(leaf)


def _signature(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(_shape_and_dtype(leaf) for leaf in leaves)


def strengthen_weak_leaves(run: Any, step_state: Any, batch: Any) -> Any:
    """`step_state` with each weakly typed leaf that the `run`'s step returns strongly typed
    made a strongly typed array of the dtype it returns (found abstractly, once per state
    and batch signature, in the loop's verdicts); the state itself where no leaf is weakly
    typed, a leaf or the step cannot be read so, or the run trains a population (whose
    members' step is another program)."""
    if run.members is not None:
        return step_state
    leaves = jax.tree.leaves(step_state)
    weak = tuple(_weak(leaf) for leaf in leaves)
    if not any(weak):
        return step_state
    try:
        (treedef, shapes), batch_signature = _signature(step_state), _signature(batch)
    except TypeError:  # a leaf that is not an array: the run's checks name it
        return step_state
    key = ("weak leaves", treedef, shapes, weak, batch_signature)
    verdicts = run.programs.cache.verdicts
    if key not in verdicts:
        verdicts[key] = _returned_dtypes(run.loop.program.step, treedef, shapes, weak, batch)
    dtypes = verdicts[key]
    if dtypes is None or not any(dtype is not None for dtype in dtypes):
        return step_state
    made = [
        leaf if dtype is None else lax.convert_element_type(leaf, dtype)
        for leaf, dtype in zip(leaves, dtypes, strict=True)
    ]
    return jax.tree.unflatten(treedef, made)


def _returned_dtypes(
    step: Any, treedef: Any, shapes: tuple[Any, ...], weak: tuple[bool, ...], batch: Any
) -> tuple[Any, ...] | None:
    """For each weakly typed leaf one step returns strongly typed, the dtype it returns
    (None for the others). Repeated with those leaves made so until nothing changes, since
    one leaf's strong type may make another's (at most one round per leaf). None where the
    step cannot be traced abstractly or changes the state's structure (the run's checks
    say so)."""
    held, dtypes = list(weak), [None] * len(weak)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(*_shape_and_dtype(a)), batch)
    for _ in weak:
        given = [
            jax.ShapeDtypeStruct(shape, dtype if made is None else made, weak_type=w)
            for (shape, dtype), made, w in zip(shapes, dtypes, held, strict=True)
        ]
        try:
            after = jax.eval_shape(
                lambda s, b: step(s, b)[0], jax.tree.unflatten(treedef, given), abstract
            )
        except Exception:  # noqa: BLE001 - the run raises its own, more specific error
            return None
        out, out_def = jax.tree.flatten(after)
        if out_def != treedef:
            return None
        turned = [i for i, o in enumerate(out) if held[i] and not o.weak_type]
        if not turned:
            break
        for i in turned:
            held[i], dtypes[i] = False, out[i].dtype
    return tuple(dtypes)
