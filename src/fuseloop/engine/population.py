"""Populations: N members of one trainer, trained by one device loop (docs/design.md §8).

A population adds a leading member axis to the carry. The step (with its metric
accumulators and non-finite guard) is vmapped over that axis, the batch is shared, and a
per-member `active` mask in the tail freezes a member that has stopped: its later steps are
computed and discarded. Member i starts as a solo run with seed `seeds[i]` would (the same
trainer init, run with that seed) and with its own optimizer hyperparameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._metrics import read_metric
from .._optim import rate_is_scheduled
from .._placement import device_signature
from .._step import init_tail, trainer_program

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

RECORD_KEY = "_population"  # where a population State keeps its record (handler_metadata)


@dataclass(frozen=True)
class Population:
    """The members of a population run.

    Attributes:
        size: How many members.
        seeds: Member i's trainer seed.
        hyperparams: `(name, per-member values)` pairs set in the optimizer's injected
            hyperparameters after init.
    """

    size: int
    seeds: tuple[int, ...]
    hyperparams: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def record(self) -> dict[str, Any]:
        """The JSON-able record a population State keeps (and a checkpoint saves)."""
        return {
            "size": self.size,
            "seeds": list(self.seeds),
            "hyperparams": {name: list(values) for name, values in self.hyperparams},
            "last_epoch": [None] * self.size,
            "halted": [False] * self.size,
            "per_member": [],
        }

    def same_members(self, record: dict[str, Any]) -> bool:
        return (
            record.get("size") == self.size
            and list(record.get("seeds", [])) == list(self.seeds)
            and dict(record.get("hyperparams", {}))
            == {name: list(values) for name, values in self.hyperparams}
        )

    @staticmethod
    def from_record(record: dict[str, Any]) -> Population:
        hyper = tuple(
            (name, tuple(float(v) for v in values))
            for name, values in dict(record.get("hyperparams", {})).items()
        )
        return Population(int(record["size"]), tuple(int(s) for s in record["seeds"]), hyper)


# ----------------------------------------------------------------- resolving run(population=)
def resolve_population(
    population: Any, program: Any, init_state: Any, *, fuse: Any, mesh: Any
) -> Population | None:
    """The population a run trains, from `run(population=...)` and a resumed State's
    record; None for a solo run. Raises a ValueError naming what is wrong.
    """
    record = _record_of(init_state)
    if population is None and record is None:
        return None
    if program.kind == "evaluator" and population is not None:
        return _evaluated(population, init_state)
    if program.kind != "trainer":
        raise ValueError(
            f"population={population!r} needs a trainer loop (fl.trainer(...)): a population "
            f"trains N members of one trainer"
        )
    if isinstance(fuse, str) and fuse == "run":
        raise ValueError(
            "population with fuse='run' (whole-run fusion) is not supported yet; use "
            "fuse=True or a chunk size with a population"
        )
    if isinstance(fuse, str) and fuse == "auto":
        raise ValueError(
            "population with fuse='auto' is not supported yet (the chunk-size probe steps a "
            "solo carry); pass fuse=True or a chunk size with a population"
        )
    if mesh is not None:
        raise ValueError(
            "population with mesh=... is not supported yet; run a population on one device "
            "(mesh=None)"
        )
    if _is_state(init_state) and record is None:
        raise ValueError(
            f"population={population!r}: init_state is a solo run's State; resume it without "
            f"population, or resume a population's State (its member(i) is a solo State)"
        )
    if population is None and record is not None:
        return Population.from_record(record)
    resolved = _from_argument(population, program)
    if record is not None and not resolved.same_members(record):
        raise ValueError(
            f"population={population!r} differs from the population init_state holds "
            f"(size {record['size']}, seeds {record['seeds']}, hyperparams "
            f"{record['hyperparams']}); leave population out to continue it"
        )
    return resolved


def _evaluated(population: Any, variables: Any) -> Population:
    """An evaluator's population: `population` members whose variables (or a population
    State's params) carry a leading member axis of that size.
    """
    if isinstance(population, bool) or not isinstance(population, (int, np.integer)):
        raise ValueError(
            f"population={population!r}: an evaluator takes the member count (an int), "
            f"the size of the variables' leading member axis"
        )
    params = getattr(variables, "params", variables)
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(params)}
    if sizes != {int(population)}:
        raise ValueError(
            f"population={population!r}: the variables' leading axes are "
            f"{sorted(map(str, sizes))}; "
            f"every leaf needs a leading member axis of size {population} (a population "
            f"State's params)"
        )
    return Population(int(population), tuple(range(int(population))))


def _is_state(value: Any) -> bool:
    return hasattr(value, "handler_metadata") and hasattr(value, "step_state")


def _record_of(init_state: Any) -> dict[str, Any] | None:
    if not _is_state(init_state):
        return None
    return init_state.handler_metadata.get(RECORD_KEY)


def _from_argument(population: Any, program: Any) -> Population:
    base = program_seed(program)
    if isinstance(population, (int, np.integer)) and not isinstance(population, bool):
        if population < 1:
            raise ValueError(f"population={population!r} must be >= 1 members")
        n = int(population)
        return Population(n, tuple(base + i for i in range(n)))
    if not isinstance(population, dict) or not population:
        raise ValueError(
            f"population={population!r} must be a member count (an int >= 1) or a dict of "
            f"per-member lists, e.g. {{'learning_rate': [1e-3, 1e-2], 'seed': [0, 1]}}"
        )
    lengths = {}
    for key, values in population.items():
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) == 0:
            raise ValueError(f"population[{key!r}]={values!r} must be a non-empty list")
        lengths[key] = len(values)
    if len(set(lengths.values())) != 1:
        described = ", ".join(f"{k}: {n}" for k, n in lengths.items())
        raise ValueError(
            f"population: the per-member lists have different lengths ({described}); give "
            f"every key one entry per member"
        )
    n = next(iter(lengths.values()))
    seeds = tuple(_seed(s) for s in population.get("seed", [base + i for i in range(n)]))
    accepted = hyperparameter_names(program.optimizer)
    hyper = []
    for key, values in population.items():
        if key == "seed":
            continue
        if key not in accepted:
            names = ", ".join(["seed", *accepted])
            raise ValueError(
                f"population: {key!r} is not a hyperparameter the optimizer exposes; accepted: "
                f"{names} (optimizers built with optax.inject_hyperparams, as the named "
                f"'sgd', 'adam' and 'adamw' are, expose theirs)"
            )
        hyper.append((key, tuple(_number(key, v) for v in values)))
    return Population(n, seeds, tuple(hyper))


def _seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"population['seed']: {value!r} must be an int")
    return int(value)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"population[{key!r}]: {value!r} must be a number")
    return float(value)


def program_seed(program: Any) -> int:
    """The trainer's seed (`fl.trainer(..., seed=)`), kept by its init."""
    seed = getattr(program, "seed", None)
    if seed is None:
        cells = dict(
            zip(program.init.__code__.co_freevars, program.init.__closure__ or (), strict=False)
        )
        if "seed" in cells:
            seed = cells["seed"].cell_contents
    if seed is None:
        raise ValueError("population: the trainer's seed could not be found")
    return int(seed)


def _inject_states(opt_state: Any) -> list[Any]:
    from .._optim import _is_inject_state

    return [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=_is_inject_state)
        if _is_inject_state(node)
    ]


def hyperparameter_names(tx: Any) -> list[str]:
    """The numeric hyperparameters `tx` keeps in its state (optax.inject_hyperparams), in
    order; a learning rate a schedule recomputes at each step is left out.
    """
    probe = {"w": jax.ShapeDtypeStruct((1,), jnp.float32)}
    try:
        state = jax.eval_shape(tx.init, probe)
    except Exception:  # noqa: BLE001 - a structure-dependent optimizer exposes none
        return []
    names: list[str] = []
    for node in _inject_states(state):
        names += [n for n in node.hyperparams if n not in names]
    if "learning_rate" in names and rate_is_scheduled(tx):
        names.remove("learning_rate")
    return names


def _set_hyperparams(opt_state: Any, values: dict[str, Any]) -> Any:
    from .._optim import _is_inject_state

    def change(node: Any) -> Any:
        if not _is_inject_state(node):
            return node
        hyper = dict(node.hyperparams)
        for name, value in values.items():
            if name in hyper:
                hyper[name] = jnp.asarray(value, jnp.result_type(hyper[name]))
        return node._replace(hyperparams=hyper)

    return jax.tree.map(change, opt_state, is_leaf=_is_inject_state)


# ----------------------------------------------------------------- device programs
def member_carry_step(carry_step: Any) -> Any:
    """`carry_step` vmapped over the member axis of the step state and the tail (the
    batch is shared). The tail's `active` mask passes through untouched: frozen members are
    restored once per chunk (`member_chunk`), not at every step.
    """

    def one(state: Any, tail: dict[str, Any], batch: Any) -> tuple[Any, dict[str, Any]]:
        inner = {k: v for k, v in tail.items() if k != "active"}
        new_state, new_inner = carry_step(state, inner, batch)
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
        return new_state, new_tail, records, n_run

    return program


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
    """Zeroed accumulators for every member, all members active."""
    tail = init_tail(metrics, guard)
    tail = jax.tree.map(lambda a: jnp.broadcast_to(a, (size,) + a.shape), tail)
    return {**tail, "active": jnp.ones((size,), jnp.bool_)}


def population_init(programs: Any, population: Population, first: Any, variables: Any) -> Any:
    """The members' initial step state (leading member axis), by one cached program: member
    i is the trainer's init run with seed `seeds[i]`, then its hyperparameters set.
    """
    treedef, spec = device_signature(first)
    names = tuple(name for name, _ in population.hyperparams)
    key = ("population", treedef, spec, names, variables is None)
    cache = programs.cache.init
    if key not in cache:
        program = programs.loop.program

        def init(variables: Any, seeds: Any, hyper: Any) -> Any:
            zeros = jax.tree.unflatten(treedef, [jnp.zeros(s, d) for s, d in spec])

            def member(seed: Any, values: Any) -> Any:
                solo = trainer_program(program.model, program.loss, program.optimizer, seed)
                step_state = solo.init(zeros, variables)
                step_state["opt_state"] = _set_hyperparams(step_state["opt_state"], values)
                return step_state

            return jax.tree.map(jnp.copy, jax.vmap(member)(seeds, hyper))

        cache[key] = jax.jit(programs.counted(init))
    seeds = np.asarray(population.seeds, np.int32)
    hyper = {name: np.asarray(values, np.float32) for name, values in population.hyperparams}
    if variables is not None and not all(
        isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(variables)
    ):
        variables = jax.device_put(variables)
    return cache[key](variables, seeds, hyper)


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
        if not np.any(np.asarray(acc["count"]) > 0):
            continue
        out[spec.name] = np.array(
            [read_metric(spec, {k: v[i] for k, v in acc.items()}) for i in range(size)],
            np.float64,
        )
    return out
