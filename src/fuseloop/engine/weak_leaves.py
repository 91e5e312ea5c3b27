"""Weakly typed leaves of a run's initial step state (docs/design.md §2).

A leaf made from a Python number (`{"k": 1.0}`, `jnp.array(1.0)`) is weakly typed: beside
a float32 array under x64, or a bfloat16 one, it takes the array's dtype, while the
strongly typed array an optimizer's update returns for it keeps its own. A plain loop's
first step then computes in the narrower dtype and its later steps in the leaf's, and a
device loop carrying the leaf would compute every step as the first. Such a leaf, which
one step makes strongly typed, is made so before the first step, fused or not: every step
computes as the plain loop's second does. A leaf the step keeps weakly typed (a counter
`n + 1`) stays as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

__all__ = ["strengthen_weak_leaves"]


def _weak(leaf: Any) -> bool:
    return bool(getattr(leaf, "weak_type", False))


def strengthen_weak_leaves(run: Any, step_state: Any, batch: Any) -> Any:
    """`step_state` with each weakly typed leaf that the `run`'s step returns strongly typed
    made a strongly typed array of its dtype (found abstractly, once per signature, in the
    loop's verdicts); the state itself where no leaf is weakly typed, the step cannot be
    traced so, or the run trains a population (whose members' step is another program)."""
    if run.members is not None:
        return step_state
    step, verdicts = run.loop.program.step, run.programs.cache.verdicts
    leaves, treedef = jax.tree.flatten(step_state)
    weak = tuple(_weak(leaf) for leaf in leaves)
    if not any(weak):
        return step_state
    try:
        shapes = tuple((np.shape(leaf), jax.numpy.result_type(leaf)) for leaf in leaves)
    except TypeError:  # a leaf that is not an array: the run's checks name it
        return step_state
    key = ("weak leaves", treedef, shapes, weak)
    if key not in verdicts:
        verdicts[key] = _made_strong(step, treedef, shapes, weak, batch)
    strong = verdicts[key]
    if strong is None or not any(strong):
        return step_state
    made = [
        lax.convert_element_type(leaf, dtype) if s else leaf
        for leaf, s, (_, dtype) in zip(leaves, strong, shapes, strict=True)
    ]
    return jax.tree.unflatten(treedef, made)


def _made_strong(
    step: Any, treedef: Any, shapes: tuple[Any, ...], weak: tuple[bool, ...], batch: Any
) -> tuple[bool, ...] | None:
    """Which weakly typed leaves one step returns strongly typed; None where the step
    cannot be traced abstractly or changes the state's structure (the run's checks say)."""
    given = [
        jax.ShapeDtypeStruct(shape, dtype, weak_type=w)
        for (shape, dtype), w in zip(shapes, weak, strict=True)
    ]
    state = jax.tree.unflatten(treedef, given)
    try:
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.numpy.result_type(a)), batch
        )
        after = jax.eval_shape(lambda s, b: step(s, b)[0], state, abstract)
    except Exception:  # noqa: BLE001 - the run raises its own, more specific error
        return None
    out, out_def = jax.tree.flatten(after)
    if out_def != treedef:
        return None
    return tuple(w and not _weak(o) for w, o in zip(weak, out, strict=True))
