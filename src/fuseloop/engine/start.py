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

from .._placement import device_signature
from .population import population_init
from .programs import Programs

__all__ = ["InlineInit", "initial_step_state", "private_copy"]


@jax.jit
def _copy_arrays(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


def private_copy(tree: Any) -> Any:
    """A device copy of every array leaf (other leaves are kept as they are), made by one
    cached program; launched asynchronously like any other.
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    to_copy = [leaves[i] for i in arrays]
    if not all(isinstance(leaf, jax.Array) for leaf in to_copy):
        # Explicit transfer of host arrays (an initial state: not counted as data transfer).
        to_copy = jax.device_put(to_copy)
    copied = _copy_arrays(to_copy)
    for i, leaf in zip(arrays, copied, strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def _on_device(tree: Any) -> Any:
    """`tree` on the device (None stays None); arrays already there are not moved again."""
    if tree is None or all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree)):
        return tree
    return jax.device_put(tree)


def _trainer_init(programs: Programs, first: Any) -> Any:
    """The cached jitted trainer init for batches shaped like `first`."""
    treedef, spec = device_signature(first)
    cache = programs.cache.init
    if (treedef, spec) not in cache:
        program = programs.loop.program

        def init(variables: Any) -> Any:
            # Initialization depends on the batch's shapes, not its values; building zeros
            # inside the program avoids moving the first batch to the device twice.
            zeros = jax.tree.unflatten(treedef, [jnp.zeros(s, d) for s, d in spec])
            return jax.tree.map(jnp.copy, program.init(zeros, variables))

        counted = programs.counted(init)
        on_cpu = jax.default_backend() == "cpu"
        cache[(treedef, spec)] = InlineInit(counted) if on_cpu else jax.jit(counted)
    return cache[(treedef, spec)]


class InlineInit:
    """The trainer init as a few programs of at most `GROUP` outputs each (on a CPU).

    XLA:CPU runs a program of more than 8 independent operations on buffers over 512 bytes
    on its thread pool, and the calling thread waits for the pool's workers; an init of a
    small model's ~15 leaves (params, the optimizer's moments, the step, the key) cost the
    host about 65 us that way, against about 23 us as two programs that each run inline on
    the calling thread (docs/design.md §6). Each program computes the whole init and keeps
    its own leaves (XLA drops the rest), so every leaf is computed as in one program. A
    step state of more than `MAX_GROUPS * GROUP` leaves (a model large enough that its init
    costs far more than the wait) is one program.
    """

    GROUP, MAX_GROUPS = 8, 4

    def __init__(self, init: Any):
        self.init = init
        self.plans: dict[Any, tuple[Any, int, list[tuple[list[int], Any]]]] = {}

    def __call__(self, variables: Any) -> Any:
        key = device_signature(variables)
        if key not in self.plans:
            self.plans[key] = self._plan(variables)
        treedef, n, programs = self.plans[key]
        leaves: list[Any] = [None] * n
        for indices, program in programs:
            for i, leaf in zip(indices, program(variables), strict=True):
                leaves[i] = leaf
        return jax.tree.unflatten(treedef, leaves)

    def _plan(self, variables: Any) -> tuple[Any, int, list[tuple[list[int], Any]]]:
        shapes, treedef = jax.tree.flatten(jax.eval_shape(self.init, variables))
        n = len(shapes)
        groups = -(-n // self.GROUP)
        if groups <= 1 or groups > self.MAX_GROUPS:
            whole = jax.jit(lambda v: jax.tree.leaves(self.init(v)))
            return treedef, n, [(list(range(n)), whole)]
        size = -(-n // groups)
        return (
            treedef,
            n,
            [
                (indices, jax.jit(lambda v, keep=tuple(indices): _select(self.init(v), keep)))
                for indices in (list(range(i, min(i + size, n))) for i in range(0, n, size))
            ],
        )


def _select(tree: Any, keep: tuple[int, ...]) -> list[Any]:
    leaves = jax.tree.leaves(tree)
    return [leaves[i] for i in keep]


def initial_step_state(programs: Programs, user_state: Any, first: Any, resuming: bool) -> Any:
    """The step state the run starts from (never aliasing the caller's arrays)."""
    program = programs.loop.program
    if program.kind == "evaluator":  # not donated: the caller's params are only read
        return program.init(first, user_state)
    if resuming:
        return private_copy(user_state)
    if programs.population is not None:  # every member from the same variables, or its own
        return population_init(programs, programs.population, first, user_state)
    if program.kind == "trainer":
        return _trainer_init(programs, first)(_on_device(user_state))
    return private_copy(program.init(first, user_state))
