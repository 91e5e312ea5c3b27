"""The step state a run starts from: built or copied once, in as few dispatches as possible.

Donation updates the step state in place, so the loop never steps the caller's arrays: the
initial state is always a private copy. The trainer's initialization (model init and
optimizer init) is one cached jitted program keyed by the first batch's shapes, so a second
run neither recompiles nor pays for hundreds of eager dispatches.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["copy_arrays", "initial_step_state", "private_copy"]


@jax.jit
def copy_arrays(tree: Any) -> Any:
    """Fresh device buffers holding the same values (a utility, not a loop program)."""
    return jax.tree.map(jnp.copy, tree)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


def private_copy(tree: Any) -> Any:
    """A device copy of every array leaf (other leaves are kept as they are)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    # Explicit transfer of host arrays (the initial state is not counted as data transfer).
    copied = copy_arrays(jax.device_put([leaves[i] for i in arrays]))
    for i, leaf in zip(arrays, copied):
        leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def _signature(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(leaf), _dtype(leaf)) for leaf in leaves)


def _dtype(leaf: Any) -> Any:
    # Canonical (x64 off: float64 -> float32), as the compiled step will see it.
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def _trainer_init(loop: Any, first: Any) -> Any:
    """The cached jitted trainer init for batches shaped like `first`."""
    treedef, spec = _signature(first)
    key = ("init", treedef, spec)
    if key not in loop._cache:
        program, counter = loop.program, loop._cache.setdefault("traces", [0])

        def init(variables: Any) -> Any:
            counter[0] += 1  # trace time only: one per compile
            # Initialization depends on the batch's shapes, not its values; building zeros
            # inside the program avoids moving the first batch to the device twice.
            zeros = jax.tree.unflatten(treedef, [jnp.zeros(s, d) for s, d in spec])
            return jax.tree.map(jnp.copy, program.init(zeros, variables))

        loop._cache[key] = jax.jit(init)
    return loop._cache[key]


def initial_step_state(loop: Any, user_state: Any, first: Any, resuming: bool) -> Any:
    """The step state the run starts from (never aliasing the caller's arrays)."""
    program = loop.program
    if program.kind == "evaluator":  # not donated: the caller's params are only read
        return program.init(first, user_state)
    if resuming:
        return private_copy(user_state)
    if program.kind == "trainer":
        placed = jax.device_put(user_state) if user_state is not None else None
        return _trainer_init(loop, first)(placed)
    return private_copy(program.init(first, user_state))
