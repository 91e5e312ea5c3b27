"""Populations: N members of one trainer, trained by one device loop (docs/design.md §8).

A population adds a leading member axis to the carry. The step (with its metric
accumulators and non-finite guard) is vmapped over that axis, the batch is shared, and a
per-member `active` mask in the tail freezes a member that has stopped: its later steps are
computed and discarded. Member i starts as a solo run with seed `seeds[i]` would (the same
trainer init, run with that seed) and with its own optimizer hyperparameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._metrics import read_metric
from .._placement import device_signature, on_one_device_set
from .._rate_groups import is_inject_state
from .._step import _trainable as trainable
from .._step import init_tail, trainer_program
from .._warn import warn
from .init_batch import abstract_batch, batch_values, reads_batch, zeros_batch
from .population_acc import PackedAcc, pack, packed_like
from .population_args import (
    RECORD_KEY,
    Population,
    check_hyperparams_on,
    exposed_on,
    resolve_population,
)

__all__ = [
    "Population",
    "RECORD_KEY",
    "resolve_population",
    "member_carry_step",
    "member_chunk",
    "masked_step",
    "population_tail",
    "population_init",
    "first_member",
    "deactivate",
]


def _set_hyperparams(opt_state: Any, values: dict[str, Any]) -> Any:
    def change(node: Any) -> Any:
        if not is_inject_state(node):
            return node
        hyper = dict(node.hyperparams)
        for name, value in values.items():
            if name in hyper:
                hyper[name] = jnp.asarray(value, jnp.result_type(hyper[name]))
        return node._replace(hyperparams=hyper)

    return jax.tree.map(change, opt_state, is_leaf=is_inject_state)


# ----------------------------------------------------------------- device programs
def member_carry_step(carry_step: Any) -> Any:
    """`carry_step` vmapped over the member axis of the step state and the tail (the
    batch is shared). The tail's `active` mask passes through untouched: frozen members are
    restored once per chunk (`member_chunk`), not at every step.
    """

    def one(state: Any, tail: dict[str, Any], batch: Any) -> tuple[Any, dict[str, Any]]:
        inner = {k: v for k, v in tail.items() if k != "active"}
        packed = inner["acc"]
        if isinstance(packed, PackedAcc):  # the metrics see their own accumulators
            inner["acc"] = packed.unpack()
        new_state, new_inner = carry_step(state, inner, batch)
        new_inner["acc"] = packed_like(new_inner["acc"], packed)
        return new_state, {**new_inner, "active": tail["active"]}

    return jax.vmap(one, in_axes=(0, 0, None))


def masked_step(carry_step: Any) -> Any:
    """A vmapped `carry_step` whose inactive members keep their carry (the `jit=False`
    path steps one batch at a time, so it restores them at every step)."""
    stepped = member_carry_step(carry_step)

    def step(state: Any, tail: dict[str, Any], batch: Any) -> tuple[Any, dict[str, Any]]:
        new_state, new_tail = stepped(state, tail, batch)
        return _restore_inactive(state, tail, new_state, new_tail)

    return step


def member_chunk(chunk_fn: Any) -> Any:
    """The device loop over a chunk for a population: every member steps every slot (the
    loop does not stop at one member's non-finite step), then the members that were
    inactive get their carry from before the chunk back, and a member whose guard tripped
    becomes inactive. One select per chunk: a member only stops at a host boundary, and
    its guard already holds its state from before the bad step.
    """

    def program(state: Any, tail: Any, chunk: Any, n_valid: Any) -> tuple[Any, ...]:
        new_state, new_tail, records, n_run = chunk_fn(state, tail, chunk, n_valid)
        new_state, new_tail = _restore_inactive(state, tail, new_state, new_tail)
        return new_state, new_tail, _frozen_records(tail, records), n_run

    return program


def _frozen_records(tail: Any, records: Any) -> Any:
    """`records` (slots first, then members) with each member inactive at the chunk's
    start showing its accumulators as they stay (the steps it computed are discarded), so
    its per-iteration metrics read as an unfused run's do.
    """
    active = tail["active"]

    def keep(record: Any, acc: Any) -> Any:
        mask = active.reshape((1,) + active.shape + (1,) * (record.ndim - 2))
        return jnp.where(mask, record, acc[None])

    return jax.tree.map(keep, records, tail["acc"])


def _restore_inactive(state: Any, tail: Any, new_state: Any, new_tail: Any) -> tuple[Any, Any]:
    active = tail["active"]

    def keep(old: Any, new: Any) -> Any:
        return jnp.where(active.reshape(active.shape + (1,) * (new.ndim - 1)), new, old)

    inner = {k: v for k, v in tail.items() if k != "active"}
    new_inner = {k: v for k, v in new_tail.items() if k != "active"}
    new_state = jax.tree.map(keep, state, new_state)
    new_inner = jax.tree.map(keep, inner, new_inner)
    if "nonfinite" in new_inner:
        active = active & ~new_inner["nonfinite"]
    return new_state, {**new_inner, "active": active}


def population_tail(metrics: Any, guard: bool, size: int) -> Any:
    """Zeroed accumulators for every member (packed: population_acc.py), all members
    active."""
    tail = init_tail(metrics, guard)
    tail["acc"] = pack(tail["acc"])
    tail = jax.tree.map(lambda a: jnp.broadcast_to(a, (size,) + a.shape), tail)
    return {**tail, "active": jnp.ones((size,), jnp.bool_)}


def require_distinct_members(model: Any, population: Population, given: bool) -> None:
    """Raises where every member would start from the same weights and differ in nothing
    else: the run was given variables to start from (`given`), or the model is built
    initialised (nnx, equinox), so the member seeds cannot reach the weights, and no
    hyperparameter varies."""
    if population.hyperparams:
        _warn_unused_seeds(model, population)
    if population.hyperparams or population.size < 2:
        return
    kind = getattr(model, "initialised_when_built", None)  # e.g. "an nnx" (model)
    if given:
        why = "every member starts from the variables given as init_state"
        other = "leave init_state out, so that each member's init takes its seed"
    elif kind is not None:
        why = f"{kind} model is initialised when built"
        other = "train a flax.linen model, whose init takes the member's seed"
    elif len(set(population.seeds)) < population.size:  # a linen model's init takes them
        warn(
            f"population: member seeds {list(population.seeds)} repeat and no "
            f"hyperparameter varies, so members of the same seed train identically (the "
            f"same weights, the same dropout masks). Give each member its own seed, or vary "
            f"a hyperparameter"
        )
        return
    else:
        return
    if len(set(population.seeds)) < 2:
        return  # one seed asked for: the members are meant alike
    raise ValueError(
        f"population={population.size}: {why}, so the member seeds "
        f"{list(population.seeds)} cannot give the members different weights: they would "
        f"all start from the same ones, and differ at most in dropout masks. Vary a "
        f"hyperparameter (e.g. population={{'learning_rate': [...]}}), or {other}"
    )


def _warn_unused_seeds(model: Any, population: Population) -> None:
    """Warns where two members differ in their seeds alone but the model takes no seed
    (nnx's): they train identically."""
    why = getattr(model, "seed_unused", None)
    seeds_of: dict[tuple[float, ...], set[int]] = {}  # hyperparameter values -> seeds
    for i, seed in enumerate(population.seeds):
        values = tuple(each[i] for _, each in population.hyperparams)
        seeds_of.setdefault(values, set()).add(seed)
    if why is None or all(len(seeds) < 2 for seeds in seeds_of.values()):
        return  # no two members differ in their seeds alone
    warn(
        f"population: the member seeds {list(population.seeds)} have no effect on this "
        f"model: {why}. Members that differ only in their seed train identically (the same "
        f"weights, the same dropout masks); vary the hyperparameters alone, or train each "
        f"seed as its own run of a model built with nnx.Rngs(seed)"
    )


def population_init(programs: Any, population: Population, first: Any, variables: Any) -> Any:
    """The members' initial step state (leading member axis), by one cached program: member
    i is the trainer's init run with seed `seeds[i]`, then its hyperparameters set.
    """
    treedef, spec = device_signature(first)
    names = tuple(name for name, _ in population.hyperparams)
    key = ("population", treedef, spec, names, variables is None)
    # A member's key is its solo run's: PRNGKey of the seed as jax takes a Python int,
    # int64 under x64 (a negative seed's high word is all ones), else its low 32 bits.
    seeds = np.asarray(population.seeds, np.int64)
    seeds = seeds if jax.config.read("jax_enable_x64") else seeds.astype(np.int32)
    # At full float width (float64 under x64): each member's slot rounds its value once,
    # to the slot's own dtype, as a solo run's optimizer does.
    wide = jax.dtypes.canonicalize_dtype(np.float64)
    hyper = {name: np.asarray(values, wide) for name, values in population.hyperparams}
    if variables is not None and not all(
        isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(variables)
    ):
        variables = jax.device_put(variables)
    variables = on_one_device_set(variables)  # a population's init is not on a hot path
    if population.deferred:
        _check_on_run_params(programs, population, treedef, spec, variables)
    cache = programs.cache.init
    if key not in cache:
        init = _members_init(programs.loop.program, treedef, spec)
        shapes = abstract_batch(treedef, spec)
        reads = variables is None and reads_batch(init, (variables, seeds, hyper), shapes)[0]
        cache[key] = (jax.jit(programs.counted(init)), reads)
    program, reads = cache[key]
    # A fresh init that reads the first batch's values takes them, as a solo run's does.
    return program(variables, seeds, hyper, batch_values(first) if reads else None)


def _check_on_run_params(
    programs: Any, population: Population, treedef: Any, spec: Any, variables: Any
) -> None:
    """Checks the varied hyperparameters of an optimizer whose state (or schedules) a
    stand-in of params cannot show against the state it makes for this run's params (found
    abstractly, then kept with the programs, so a second run traces and compiles nothing
    for it)."""
    leaves, given = jax.tree.flatten(variables)
    shapes = tuple((np.shape(leaf), str(jnp.result_type(leaf))) for leaf in leaves)
    key = ("population hyperparams", treedef, spec, given, shapes)
    cache, program = programs.cache.init, programs.loop.program
    if key not in cache:
        solo = trainer_program(program.model, program.loss, program.optimizer, 0)
        made = jax.eval_shape(solo.init, abstract_batch(treedef, spec), variables)
        params, _ = trainable(made["params"])
        opt_state = made["opt_state"]
        cache[key] = (exposed_on(program.optimizer, opt_state, params), opt_state)
    check_hyperparams_on(population, *cache[key])


def _members_init(program: Any, treedef: Any, spec: Any) -> Callable[..., Any]:
    def init(variables: Any, seeds: Any, hyper: Any, batch: Any) -> Any:
        if batch is None:  # only the first batch's shapes count (init_batch.py)
            batch = zeros_batch(treedef, spec)

        def member(seed: Any, values: Any) -> Any:
            solo = trainer_program(program.model, program.loss, program.optimizer, seed)
            step_state = solo.init(batch, variables)
            step_state["opt_state"] = _set_hyperparams(step_state["opt_state"], values)
            return step_state

        return jax.tree.map(jnp.copy, jax.vmap(member)(seeds, hyper))

    return init


@jax.jit
def _first(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[0], tree)


def first_member(step_state: Any) -> Any:
    """Member 0's step state (for the checks a solo step state gets)."""
    return _first(step_state)


@jax.jit
def _deactivate(active: Any, keep: Any) -> Any:
    return active & keep


def deactivate(tail: Any, stopped: np.ndarray) -> Any:
    """`tail` with the members where `stopped` is True made inactive (frozen)."""
    keep = jnp.asarray(~np.asarray(stopped, bool))
    return {**tail, "active": _deactivate(tail["active"], keep)}


# ----------------------------------------------------------------- host values
def member_metrics(specs: Any, acc_host: dict[str, Any], size: int) -> dict[str, np.ndarray]:
    """Per-member host values (float64 arrays of shape (N,)) of accumulators already on the
    host; a metric no member has counted yet is left out.
    """
    out = {}
    for spec in specs:
        acc = acc_host[spec.name]
        counted = np.asarray(acc["count"]) > 0
        if not counted.any():
            continue
        # A member that counted nothing (halted) reads NaN, whatever the metric keeps (a
        # "last" value's sum is a fresh 0 there, not a rate).
        out[spec.name] = np.array(
            [
                read_metric(spec, {k: v[i] for k, v in acc.items()}) if counted[i] else np.nan
                for i in range(size)
            ],
            np.float64,
        )
    return out
