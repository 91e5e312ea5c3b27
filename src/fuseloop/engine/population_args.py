"""Resolving `run(population=...)`: the members a population run trains (docs/design.md §8).

`resolve_population` turns the argument (a member count or a dict of per-member seeds and
optimizer hyperparameters) and a resumed State's record into a `Population`, or raises a
ValueError naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._arg_types import is_int
from .._epoch_order import prng_impl
from .._optim import abstract_state
from .._optim_probe import scheduled_hyperparams
from .._rate_groups import inject_states

__all__ = ["Population", "RECORD_KEY", "resolve_population"]

RECORD_KEY = "_population"  # where a population State keeps its record (handler_metadata)


@dataclass(frozen=True)
class Population:
    """The members of a population run.

    Attributes:
        size: How many members.
        seeds: Member i's trainer seed.
        hyperparams: `(name, per-member values)` pairs set in the optimizer's injected
            hyperparameters after init.
        deferred: The hyperparameters are checked on the run's own params, at the members'
            init (`check_hyperparams_on`): a stand-in of params shows neither the
            optimizer's state nor its schedules (`resolve_population` checks the others).
    """

    size: int
    seeds: tuple[int, ...]
    hyperparams: tuple[tuple[str, tuple[float, ...]], ...] = ()
    deferred: bool = field(default=False, compare=False)

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
            f"trains N members of one trainer. For a custom loop, keep the members in the "
            f"step state with a leading axis and jax.vmap the step over it, or train each "
            f"member as its own run"
        )
    if mesh is not None:
        raise ValueError(
            "population with mesh=... is not supported yet; run a population on one device "
            "(mesh=None)"
        )
    _require_per_key_vmap(population if population is not None else (record or {}).get("size"))
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


def _require_per_key_vmap(population: Any) -> None:
    """Raises under a PRNG kind whose random bits, vmapped over the members' keys, come from
    one key for the whole batch (JAX's "rbg" and "unsafe_rbg"): member i would then not
    train as the solo run with its seed, the population's promise (docs/design.md §8)."""
    impl = prng_impl()
    if impl in ("rbg", "unsafe_rbg"):
        raise ValueError(
            f"population={population!r}: JAX's PRNG kind is {impl!r} "
            f"(jax_default_prng_impl), whose random bits under vmap are drawn from one key "
            f"for all members, so member i would not train as the solo run with its seed. "
            f"Train a population under JAX's default PRNG "
            f"(jax.config.update('jax_default_prng_impl', 'threefry2x32')), or train the "
            f"members as solo runs"
        )


def _evaluated(population: Any, variables: Any) -> Population:
    """An evaluator's population: `population` members whose variables (or a population
    State's params) carry a leading member axis of that size.
    """
    if not is_int(population):
        raise ValueError(
            f"population={population!r}: an evaluator takes the member count (an int), "
            f"the size of the variables' leading member axis"
        )
    params = getattr(variables, "params", variables)
    if params is None:
        raise ValueError(
            f"population={population!r}: an evaluator evaluates the members it is given; "
            f"pass the population's State a trainer returned (or variables with a leading "
            f"member axis of {population}) as init_state: "
            f"evaluator.run(data, state, population={population})"
        )
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


def _member_values(values: Any) -> Any:
    """A numpy or jax array of per-member values, or a range, as its list."""
    if isinstance(values, range) or (hasattr(values, "__array__") and np.ndim(values) == 1):
        return np.asarray(values).tolist()
    return values


def _from_argument(population: Any, program: Any) -> Population:
    base = program_seed(program)
    if is_int(population):
        if population < 1:
            raise ValueError(f"population={population!r} must be >= 1 members")
        n = int(population)
        where = "member seeds (the trainer's seed + the member's index)"
        _seed(base + n - 1, where)  # the last one first: not after billions of members
        return Population(n, tuple(_seed(base + i, where) for i in range(n)))
    if not isinstance(population, dict) or not population:
        raise ValueError(
            f"population={population!r} must be a member count (an int >= 1) or a dict of "
            f"per-member lists, e.g. {{'learning_rate': [1e-3, 1e-2], 'seed': [0, 1]}}"
        )
    population = {k: _member_values(v) for k, v in population.items()}
    lengths = {}
    for key, values in population.items():
        if not isinstance(values, (list, tuple)) or len(values) == 0:
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
    varied = set(population) - {"seed"}  # hyperparameters: read from the optimizer's state
    optimizer_state = abstract_state(program.optimizer) if varied else None
    scheduled = None if optimizer_state is None else scheduled_hyperparams(program.optimizer)
    # Where a stand-in of params shows neither (an optimizer whose state or schedules
    # follow the params' structure), they are checked on the run's params, at init.
    exposed = None if scheduled is None else _Exposed.of(optimizer_state, scheduled)
    hyper = []
    for key, values in population.items():
        if key == "seed":
            continue
        if exposed is not None:
            exposed.refuse_unexposed(key)
        numbers = tuple(_number(key, v) for v in values)
        if exposed is not None:
            _require_one_float_slot(optimizer_state, key, numbers)
        hyper.append((key, numbers))
    return Population(n, seeds, tuple(hyper), deferred=bool(hyper) and exposed is None)


def _require_one_float_slot(state: Any, key: str, values: tuple[float, ...]) -> None:
    """Raises a ValueError where the optimizer's (abstract) `state` injects `key` in several
    transformations, or keeps it as an integer (built with `learning_rate=1`) and a
    member's value has a fraction, which the slot would cut (0.1 to 0: a member that never
    trains)."""
    holding = [n for n in inject_states(state) if key in n.hyperparams]  # None: none
    if len(holding) > 1:  # one value per member, but for which transformation?
        raise ValueError(
            f"population[{key!r}]: {len(holding)} transformations of the optimizer inject a "
            f"{key!r} (an optax.chain or multi_transform of several), and a member's value "
            f"would replace every one of them; inject it in one only (build the others with "
            f"a fixed value, e.g. optax.sgd(0.1)), or under distinct names to vary each"
        )
    for node in holding:
        slot = node.hyperparams[key]
        if jnp.issubdtype(slot.dtype, jnp.inexact):
            continue
        cut = next((v for v in values if v != int(v)), None)
        if cut is not None:
            raise ValueError(
                f"population[{key!r}]: the optimizer keeps {key} as {slot.dtype} (it was "
                f"built with an integer, e.g. {key}=1), so a member's {cut} would be cut to "
                f"{int(cut)}; build the optimizer with a float ({key}=1.0)"
            )


@dataclass(frozen=True)
class _Exposed:
    """The hyperparameters an optimizer state exposes to a population: those it injects,
    less those a schedule recomputes at each update (`scheduled`)."""

    accepted: tuple[str, ...]
    scheduled: frozenset[str]

    @staticmethod
    def of(state: Any, scheduled: frozenset[str] | None) -> _Exposed:
        names: list[str] = []
        for node in inject_states(state):
            names += [n for n in node.hyperparams if n not in names]
        scheduled = scheduled or frozenset()
        return _Exposed(tuple(n for n in names if n not in scheduled), scheduled)

    def refuse_unexposed(self, key: str) -> None:
        if key in self.accepted:
            return
        if key in self.scheduled:
            raise ValueError(
                f"population: {key!r} is recomputed by a schedule in this optimizer, so a "
                f"member's value would be overwritten at its first step; inject a number "
                f"(e.g. optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)) to give "
                f"each member its own, or vary the schedule's own parameters in separate runs"
            )
        names = ", ".join(["seed", *self.accepted])
        raise ValueError(
            f"population: {key!r} is not a hyperparameter the optimizer exposes; accepted: "
            f"{names} (an optimizer built with optax.inject_hyperparams exposes those "
            f"it was given: optax.inject_hyperparams(optax.sgd)(learning_rate=0.01, "
            f"momentum=0.9) exposes momentum, the named 'sgd' does not)"
        )


def exposed_on(tx: Any, opt_state: Any, params: Any) -> _Exposed:
    """What `tx` exposes in `opt_state`, the (abstract) state it makes for the run's own
    `params`: for an optimizer whose state depends on the params' structure
    (`optax.multi_transform` or `optax.masked` given a tree of labels), which
    `resolve_population` cannot probe on a stand-in. Which hyperparameters a schedule
    recomputes is probed by one jitted update of small gradients on zeros shaped as
    `params` (`_optim_probe`)."""
    zeros = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), params)
    scheduled = scheduled_hyperparams(tx, zeros, compiled=True)
    if scheduled is None:
        raise ValueError(
            "population: fuseloop's probe of the optimizer (updates of small gradients on the "
            "model's params, until each optax.MultiSteps in it has applied) failed or never "
            "applied, so which hyperparameters a schedule recomputes (and would overwrite at "
            "a member's first step) is unknown; check that a solo run with this optimizer "
            "trains, and if it does, train the members as solo runs"
        )
    return _Exposed.of(opt_state, scheduled)


def check_hyperparams_on(population: Population, exposed: _Exposed, opt_state: Any) -> None:
    """Refuses a varied hyperparameter `exposed` (from `exposed_on`) does not hold, or one
    `opt_state` injects in several transformations or keeps as an integer."""
    for key, numbers in population.hyperparams:
        exposed.refuse_unexposed(key)
        _require_one_float_slot(opt_state, key, numbers)


def _scalar(value: Any) -> Any:
    """A 0-d numpy or jax array as its number (`list(jnp.logspace(...))` gives those);
    anything else as it is."""
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape == ():
        try:  # a typed key or a traced value has no number: refused as it is
            return value.item()
        except Exception:
            return value
    return value


def _seed(value: Any, where: str = "population['seed']") -> int:
    value = _scalar(value)
    if not is_int(value):
        raise ValueError(f"{where}: {value!r} must be an int")
    # A member's key is drawn on the device from the seed's 32 bits, as a solo run's is
    # drawn from them on the host: seeds in [2**31, 2**32) are taken (as their int32 bits).
    if not -(2**31) <= int(value) < 2**32:
        raise ValueError(
            f"{where}: {value} is outside 32 bits (each member's key is drawn on the device "
            f"from the seed's 32 bits, as a solo run of the same seed draws it): use seeds "
            f"in [-2**31, 2**32), e.g. seed % 2**32"
        )
    return int(value)


def _number(key: str, value: Any) -> float:
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"population[{key!r}]: {value!r} must be a number")
    if not np.isfinite(value):
        raise ValueError(f"population[{key!r}]: {value!r} must be a finite number")
    if key == "learning_rate" and value < 0:
        raise ValueError(
            f"population['learning_rate']: {value!r} is negative, which would climb the "
            f"loss; learning rates are >= 0"
        )
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
