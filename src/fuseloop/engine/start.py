"""The step state a run starts from: built or copied once, in as few dispatches as possible.

Donation updates the step state in place, so the loop never steps the caller's arrays: the
initial state is always a private copy. The trainer's initialization (model init and
optimizer init) is one cached jitted program keyed by the first batch's shapes, so a second
run neither recompiles nor pays for hundreds of eager dispatches. Under jax.distributed,
every process checks here that it starts the same run as the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._config_digest import (
    describe_handlers,
    describe_mesh,
    describe_metrics,
    is_dataset,
    source_digest,
)
from .._copies import gathering_call, private_copy
from .._distributed import (
    check_same_config,
    describe,
    describe_source,
    describe_step,
    describe_values,
    process_count,
)
from .._epoch_order import prng_config
from .._placement import (
    default_device_key,
    device_int,
    device_signature,
    signature_of,
    tree_bytes,
)
from .._variables_diff import refuse_narrowed_state, warn_other_dtype
from .conv_layout import named
from .init_batch import abstract_batch, batch_values, reads_batch, zeros_batch
from .population import population_init, require_distinct_members
from .programs import Programs

__all__ = [
    "InlineInit",
    "Start",
    "agree_across_processes",
    "agree_on_mesh",
    "initial_step_state",
]


def _trainer_init(programs: Programs, first: Any) -> Any:
    """The cached jitted trainer init for batches shaped like `first`."""
    treedef, spec = device_signature(first)
    cache = programs.cache.init
    if (treedef, spec) not in cache:
        program = programs.loop.program

        def init(variables: Any, batch: Any) -> Any:
            # A fresh init reads the first batch, as `model.init(rng, x)` does (an offset or
            # a scale set from the data: ActNorm); from given variables only its shapes
            # count, and zeros made inside the program move nothing to the device.
            if batch is None:
                batch = zeros_batch(treedef, spec)
            return jax.tree.map(jnp.copy, program.init(batch, variables))

        counted = programs.counted(init)
        looped = jax.default_backend() == "cpu"
        cache[(treedef, spec)] = InlineInit(counted, looped, abstract_batch(treedef, spec))
    return cache[(treedef, spec)]


class InlineInit:
    """The trainer init, one cached program per signature of the variables it is given;
    on a CPU, a small step state's init is one program whose work sits in a loop of one
    trip.

    XLA:CPU runs a program with few flops on the calling thread, and one of more than 8
    independent operations on buffers over 512 bytes is spread over its thread pool, the
    caller waiting for the pool's workers: a small model's init (params, the optimizer's
    moments, step, key: ~15 outputs) cost the host about 45-65 us that way. Inside a loop
    the same operations run one after another on the calling thread, in one dispatch:
    about 23 us (docs/design.md §6). The loop's trip count is a device scalar, so XLA
    cannot see one trip and unroll it; its body is the whole init, so every value is the
    plain program's. A step state over `LOOP_BYTES` (where copying on several threads
    pays for the wait), or any off a CPU (`looped=False`), is the plain program.

    `start` returns the step state with its signature, `(treedef, ((shape, dtype),
    ...))`, known when the program was built: the run's step-state check is keyed by it
    without walking the new state (`Checker.variables`).
    """

    LOOP_BYTES = 256 * 1024

    def __init__(self, init: Any, looped: bool = True, batch: Any = None):
        self.init, self.looped = init, looped
        self.batch = batch  # the first batch's shapes and dtypes (None: no batch read)
        # By variables' signature: the state's treedef and signature, the program, whether
        # it reads the first batch's values (a fresh data-dependent init, init_batch.py),
        # and whether a spare may stand in for it (a small state that reads no batch).
        self.programs: dict[Any, tuple[Any, Any, Any, bool, bool]] = {}
        # The spare: a step state made ahead, from the variables a run last started from,
        # while that run waited for the device (`start`'s maker, docs/design.md §6).
        self._spare: tuple[_Given, Any] | None = None
        self._lock = threading.Lock()  # one run takes a spare: the next launch donates it

    def start(
        self, variables: Any, first: Any = None
    ) -> tuple[Any, Any, Callable[[], None] | None]:
        """The step state made from `variables` (None: fresh, from the `first` batch), its
        signature, and what makes the next run's spare (None: no spare is kept). Host
        arrays among the variables move to the device first (arrays there stay put).

        A small step state made from device arrays, which no one can change, is made
        again once this run has launched and before it waits for the device
        (`Carry.start`); a run from the same arrays takes it and starts without this
        program's dispatch.
        """
        leaves, structure = jax.tree.flatten(variables)
        on_device = all(isinstance(leaf, jax.Array) for leaf in leaves)
        if not on_device:
            variables = jax.device_put(variables)  # the initial state: not counted as data
            leaves = jax.tree.leaves(variables)
        key = signature_of(leaves, structure)
        if key not in self.programs:
            self.programs[key] = self._program(variables)
        treedef, signature, program, reads, spares = self.programs[key]
        batch = batch_values(first) if reads else None
        given = _Given(leaves, structure) if on_device and spares else None
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and given is not None and spare[0].same(given):
            state = spare[1]
        else:
            made = gathering_call(program, variables, batch, device_int(1))
            state = jax.tree.unflatten(treedef, made)
        if given is None:
            return state, signature, None

        def spare_maker() -> None:
            if any(leaf.is_deleted() for leaf in given.leaves):
                return  # the caller let its variables go during the run: nothing to reuse
            made = jax.tree.unflatten(
                treedef, gathering_call(program, variables, None, device_int(1))
            )
            with self._lock:
                self._spare = (given, made)

        return state, signature, spare_maker

    def _program(self, variables: Any) -> tuple[Any, Any, Any, bool, bool]:
        """`(treedef, signature, program, reads, spares)` for `variables`' signature: a
        fresh init that reads the first batch's values takes the batch (no spare stands in
        for it: the next run's first batch differs); any other makes zeros of its shapes."""
        if variables is None and self.batch is not None:  # fresh: one trace tells both
            reads, out = reads_batch(self.init, (variables,), self.batch)
        else:
            reads, out = False, jax.eval_shape(self.init, variables, None)
        shapes, treedef = jax.tree.flatten(out)
        signature = treedef, tuple((tuple(s.shape), s.dtype) for s in shapes)
        small = tree_bytes(shapes) <= self.LOOP_BYTES
        if not self.looped or not small:
            plain = named(lambda v, b, _: jax.tree.leaves(self.init(v, b)), "init")
            return treedef, signature, jax.jit(plain), reads, small and not reads

        def looped(v: Any, b: Any, trips: Any) -> list[Any]:
            empty = [jnp.zeros(s.shape, s.dtype) for s in shapes]
            return lax.fori_loop(0, trips, lambda _, __: jax.tree.leaves(self.init(v, b)), empty)

        program = jax.jit(named(looped, "init_looped"))
        return treedef, signature, program, reads, not reads


def _made_under() -> tuple[Any, ...]:
    """The JAX settings an initial state's values depend on beyond its inputs: the random
    bits (`prng_config`), jit (eager init rounds differently), x64 and matmul precision."""
    config = jax.config
    settings = ("jax_disable_jit", "jax_enable_x64", "jax_default_matmul_precision")
    return (prng_config(), *(getattr(config, name, None) for name in settings))


class _Given:
    """The variables a spare was made from, by identity: device arrays cannot change, so
    the same arrays (none deleted since), on the same default device and under the same
    JAX settings (`_made_under`), make the same state.
    """

    __slots__ = ("leaves", "structure", "device", "settings")

    def __init__(self, leaves: list[Any], structure: Any):
        self.leaves, self.structure = tuple(leaves), structure
        self.device, self.settings = default_device_key(), _made_under()

    def same(self, other: _Given) -> bool:
        return (
            self.structure == other.structure
            and self.device == other.device
            and self.settings == other.settings
            and len(self.leaves) == len(other.leaves)
            and all(a is b for a, b in zip(self.leaves, other.leaves, strict=True))
            and not any(leaf.is_deleted() for leaf in self.leaves)
        )


class Start(NamedTuple):
    """What a run starts from: the step state (never aliasing the caller's arrays), its
    signature where the program that made it knows it (`InlineInit`), and what makes a
    spare of it for the next run, for the carry to call once a chunk is launched (or
    None)."""

    step_state: Any
    signature: Any = None
    spare_maker: Callable[[], None] | None = None


def initial_step_state(
    programs: Programs, user_state: Any, first: Any, resuming: bool, fit: Any = None
) -> Start:
    """The step state the run starts from (see `Start`); a resumed State's params are
    compared with the dtypes the model's init makes (`fit`: the run's `ModelFit`)."""
    program = programs.loop.program
    warn_held_modes = getattr(program.model, "warn_held_modes", None)
    if warn_held_modes is not None and program.kind == "trainer":
        warn_held_modes()  # nnx layers set to evaluation mode since the trainer was built
    if program.kind == "evaluator":  # not donated: the caller's params are only read
        return Start(program.init(first, user_state))
    if resuming:
        refuse_narrowed_state(user_state)
        if fit is not None and fit.checked and isinstance(user_state, dict):
            warn_other_dtype(user_state.get("params"), fit.fresh)
        return Start(private_copy(user_state))
    if program.kind == "trainer":
        if programs.population is not None:
            given = user_state is not None
            require_distinct_members(program.model, programs.population, given)
        if user_state is None:
            user_state = _built_variables(program.model)
    if programs.population is not None:  # every member from the same variables, or its own
        return Start(population_init(programs, programs.population, first, user_state))
    if program.kind == "trainer":
        init: InlineInit = _trainer_init(programs, first)
        return Start(*init.start(user_state, first))
    return Start(private_copy(program.init(first, user_state)))


def _built_variables(model: Any) -> Any:
    """The variables of a model that initialises when it is built and can change after
    (an nnx module: weights loaded into it later count), read now; None for any other
    model, whose init the trainer runs."""
    current = getattr(model, "current_variables", None)
    return current() if current is not None else None


def agree_across_processes(run: Any, first: Any, step_state: Any) -> None:
    """Under jax.distributed every process must run the same configuration: a difference
    is an error naming it, before anything trains. A collective, so every process calls it
    at the same point of its run's start (`run` is the `Run`).
    """
    if process_count() > 1:
        check_same_config(
            {
                "epochs": run.epochs,
                "iterations": run.iterations,
                "fuse": str(run.fuse),
                "first_batch (shapes: the batch size)": describe(first),
                "data": describe_source(run.source.data),
                "step_state (structure and shapes: the model)": describe(step_state),
                "step_state values (the seed or initial weights)": describe_values(step_state),
                "training step (e.g. the optimizer's constants, the loss)": (
                    describe_step(run.loop.program, step_state, first)
                ),
                "handlers (their settings)": describe_handlers(run.loop.registrations),
                "metrics": describe_metrics(run.loop.metrics),
                "data values": _values_of(run.source.data),
            }
        )


def agree_on_mesh(mesh: Any) -> None:
    """The processes' meshes, compared before the first array is placed on one: a mesh
    that differs (devices, their order) would hang the first collective placement."""
    if process_count() > 1:
        check_same_config({"mesh (its axes and devices, in order)": describe_mesh(mesh)})


def _values_of(data: Any) -> str:
    """An in-memory dataset's digest (each process takes its rows of the whole); other
    sources hold each process's own share, so their values differ by design."""
    return source_digest(data) if is_dataset(data) else "per process"
