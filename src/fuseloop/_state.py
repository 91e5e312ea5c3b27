"""The State handlers see, and the run statistics.

State is immutable: handlers change it by returning `state.replace(...)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np

from ._population import POPULATION_KEY, member_state, stop_members

__all__ = [
    "POPULATION_KEY",
    "RESTORED_KEY",
    "without_restored",
    "AHEAD_KEY",
    "HELD_KEY",
    "NONFINITE_KEY",
    "UNFINISHED_KEY",
    "RunStatus",
    "State",
    "attach_to_error",
    "freeze_arrays",
    "new_stats",
    "records_of",
    "with_epoch_recorded",
    "written_in_place",
]

# `handler_metadata` key: the epoch whose step state `early_stop(restore_best=True)` put in
# the State, where that is not its last epoch's (a resume from it warns).
RESTORED_KEY = "_restored_best_epoch"
# ... and the (epoch, iteration) a multi-epoch dispatch's carry had reached when its replay
# raised at an earlier point: the State's step state is that far ahead of its history.
AHEAD_KEY = "_step_state_reached"
# ... and how many of its epoch's steps the step state of a run that stopped inside an epoch
# holds: a fused chunk runs whole, so it can hold more steps than the iterations that fired
# (a halt at a chunk's first `iteration_started` fired none of them).
HELD_KEY = "_epoch_steps_held"
# ... and where the guard (`terminate_on_nan`) met a non-finite loss: {"epoch", "iteration"}.
NONFINITE_KEY = "_nonfinite_at"
# ... and the epoch whose `epoch_completed` handlers a raising handler left unfinished (the
# State it was given): {"epoch", "handler"}; a resume from it starts at the next epoch.
UNFINISHED_KEY = "_epoch_end_unfinished"

RunStatus: TypeAlias = Literal["running", "completed", "halted"]
"""`State.status`: a run in progress, one that ran all its epochs, or one that halted."""


def new_stats() -> dict[str, Any]:
    """The counters of one run (docs/design.md, observability)."""
    return {
        "dispatches": 0,
        "host_syncs": 0,
        "h2d_transfers": 0,
        "compiles": 0,
        "chunk_size": 1,
        "epoch_time": {},
    }


def without_restored(metadata: dict[str, Any]) -> dict[str, Any]:
    """Handler metadata without the note of a restored best epoch's step state
    (RESTORED_KEY); `metadata` itself where it holds none."""
    if RESTORED_KEY not in metadata:
        return metadata
    return {k: v for k, v in metadata.items() if k != RESTORED_KEY}


@dataclass(frozen=True, eq=False, repr=False)
class State:
    """What handlers see and what `Loop.run` returns.

    Attributes:
        epoch: The current epoch (0-based).
        max_epoch: The number of epochs the run trains for in total.
        iteration: The current iteration within the epoch (0-based).
        max_iteration: The bound on iterations per epoch: `iterations`, or the epoch's
            length where the data (a list, `fl.data.arrays`) is shorter; `None` without
            `iterations`.
        metrics: This epoch's metrics, name -> Python float (or array).
        history: Epoch -> that epoch's metrics.
        step_state: The device-side step state (`None` inside iteration handlers of a fused
            loop). Its arrays are donated to the next step: copy what you keep.
        handler_metadata: Free-form per-handler data that survives checkpoints.
        event_counts: Iteration events: `{"total": n, "epoch": n}`; others: an int.
        status: `"running"`, `"completed"` or `"halted"`.
        times: Epoch -> wall seconds.
        stats: Dispatch/sync/transfer/compile counters of the current run. `compiles`
            counts the step programs it traced (chunk, unfused step, resident, multi-epoch
            dispatch), not the small ones around them (the initial state, zeroed
            accumulators, an epoch's order), its `validate` evaluator's included: a second
            run of a loop counts 0; an epoch-end handler reads the count so far. The
            evaluator's runs (outside a multi-epoch dispatch) are runs of their own,
            counted in none of the other counters.
            `h2d_transfers` counts chunks prepared (those prepared ahead of a halt too).

    Example:
        >>> s = State()
        >>> s.replace(epoch=3).epoch
        3
    """

    epoch: int = 0
    max_epoch: int = 1
    iteration: int = 0
    max_iteration: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    step_state: Any = None
    handler_metadata: dict[str, Any] = field(default_factory=dict)
    event_counts: dict[str, Any] = field(default_factory=dict)
    status: RunStatus = "running"
    times: dict[int, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=new_stats)

    def __eq__(self, other: object) -> bool:
        """Field by field, arrays by their values (two States of the same run compare
        equal after a pickle round trip); NaN equals NaN, as in a history."""
        if not isinstance(other, State):
            return NotImplemented
        names = (f.name for f in dataclasses.fields(self))
        return all(_same_tree(getattr(self, n), getattr(other, n)) for n in names)

    __hash__ = None  # type: ignore[assignment]  # mutable dicts inside: not hashable

    def __repr__(self) -> str:
        """A summary: the counters, status and metrics; the step state by its size (its
        arrays would run to many kilobytes)."""
        return (
            f"State(epoch={self.epoch}, max_epoch={self.max_epoch}, iteration={self.iteration}, "
            f"max_iteration={self.max_iteration}, status={self.status!r}, "
            f"metrics={_short_metrics(self.metrics)}, history=<{len(self.history)} epochs>, "
            f"step_state={_size_of(self.step_state)})"
        )

    def replace(self, **changes: Any) -> State:
        """Returns a copy with `changes` applied.

        Example:
            >>> State(epoch=1).replace(metrics={"loss": 0.5}).metrics
            {'loss': 0.5}
        """
        names = _field_names(type(self))
        if not names.issuperset(changes):
            unknown = sorted(set(changes) - names)
            params = (
                "; params is read from the step state: state.replace(step_state={"
                "**state.step_state, 'params': new_params})"
                if "params" in changes
                else ""
            )
            raise ValueError(
                f"State.replace got unknown fields {unknown}; accepted: "
                f"{', '.join(f.name for f in dataclasses.fields(self))}{params}"
            )
        # A shallow copy with the changes: what dataclasses.replace does for a State (no
        # __post_init__, no init-only fields), without re-running __init__ - the loop
        # replaces States at every event.
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy

    @property
    def population(self) -> int | None:
        """The number of members of a population run's State (None for a solo run's)."""
        record = self.handler_metadata.get(POPULATION_KEY)
        return None if record is None else int(record["size"])

    def member(self, i: int) -> State:
        """Member `i` of a population as a plain solo State: its step state, metrics,
        history (up to its own halting epoch), status and monitor records. Its iteration
        and event counts are the population run's (docs/design.md §8).

        Example:
            >>> import numpy as np
            >>> s = State(metrics={"loss": np.array([0.5, 0.25])},
            ...           handler_metadata={"_population": {"size": 2, "seeds": [0, 1],
            ...               "last_epoch": [None, None], "halted": [False, False]}})
            >>> s.member(1).metrics
            {'loss': 0.25}
        """
        member: State = member_state(self, i)
        return member

    def stop_members(self, stopped: Any) -> State:
        """A population State with the members where `stopped` (N bools) is True halted
        at this epoch (their history ends here; the run freezes them). Used by per-member
        monitors such as `early_stop`.

        Example:
            >>> s = State(epoch=2, handler_metadata={"_population": {"size": 2,
            ...     "seeds": [0, 1], "last_epoch": [None, None], "halted": [False, False]}})
            >>> s.stop_members([False, True]).handler_metadata["_population"]["last_epoch"]
            [None, 2]
        """
        stopped_state: State = stop_members(self, stopped)
        return stopped_state

    @property
    def params(self) -> Any:
        """`step_state["params"]`: the variables `model.apply` accepts."""
        if isinstance(self.step_state, dict) and "params" in self.step_state:
            return self.step_state["params"]
        return None


_FIELD_NAMES: dict[type, frozenset[str]] = {}


def _field_names(cls: type) -> frozenset[str]:
    if cls not in _FIELD_NAMES:
        _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return _FIELD_NAMES[cls]


def _short_metrics(metrics: dict[str, Any]) -> str:
    """The metrics as a dict's repr, a population's arrays (one value per member) by their
    shape and range: 256 members' values would run to kilobytes."""
    shown = []
    for name, value in metrics.items():
        size = int(getattr(value, "size", 1))
        text = repr(value) if size <= 4 else _array_summary(value)
        shown.append(f"{name!r}: {text}")
    return "{" + ", ".join(shown) + "}"


def _array_summary(value: Any) -> str:
    """`<(256,) 0.01..0.9>`: an array's shape and the range of its finite values."""
    import numpy as np

    try:
        if np.iscomplexobj(value):
            raise TypeError("complex")
        values = np.asarray(value, np.float64)
    except (TypeError, ValueError):  # not real numbers
        return f"<array of shape {np.shape(value)}>"
    finite = values[np.isfinite(values)]  # halted members read NaN
    span = f"{finite.min():.4g}..{finite.max():.4g}" if finite.size else "no finite value"
    return f"<{values.shape} {span}>"


def _size_of(tree: Any) -> str:
    """`<n arrays, m values>` for a step state (None as is)."""
    if tree is None:
        return "None"
    import jax

    from ._arg_types import concrete_deleted

    leaves = jax.tree.leaves(tree)
    gone = sum(map(concrete_deleted, leaves))
    deleted = f", {gone} deleted (reused by the run after this State was kept)" if gone else ""
    values = sum(int(getattr(a, "size", 1)) for a in leaves)
    return f"<{len(leaves)} arrays, {values:,} values{deleted}>"


def _same_tree(a: Any, b: Any) -> bool:
    """Whether two pytrees have one structure and equal leaves (arrays by value, typed
    PRNG keys by their data, NaN equal to NaN)."""
    import jax
    import numpy as np

    from ._prng_keys import raw_keys

    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    structure: object = tree_a  # no stub for PyTreeDef: compare as objects
    if structure != tree_b:
        return False

    def plain(leaf: Any) -> Any:  # a typed PRNG key has no numpy form: its data has
        return np.asarray(raw_keys(leaf))

    for x, y in zip(map(plain, leaves_a), map(plain, leaves_b), strict=True):
        nan_aware = x.dtype.kind in "fc" and y.dtype.kind in "fc"
        if x.shape != y.shape or not np.array_equal(x, y, equal_nan=nan_aware):
            return False
    return True


def attach_to_error(error: BaseException, state: State) -> None:
    """`error.fuseloop_state`: the State reached (an outer run overwrites an inner one's,
    so a validation run's error reports the training run's State), with a note where its
    step state is gone."""
    from ._arg_types import holds_deleted_arrays

    # An exception type without attributes: nothing to attach to.
    with contextlib.suppress(AttributeError):
        error.fuseloop_state = state  # type: ignore[attr-defined]
    if holds_deleted_arrays(state.step_state) and _CONSUMED not in getattr(error, "__notes__", []):
        error.add_note(_CONSUMED)


# A step that fails on the device (a host callback raising in it) takes the carry with it:
# every program donates the step state it is given, and keeping a copy per dispatch would
# double the carry's memory and cost a copy each launch.
_CONSUMED = (
    "fuseloop: the failed step ran on the device with the step state handed to it (donated), "
    "so err.fuseloop_state holds the counters and history reached but no step state to save "
    "or resume from (its arrays are deleted); Loop.checkpoint(...) keeps the last one saved"
)


def with_epoch_recorded(state: State, epoch: int) -> State:
    """`state` with its metrics recorded as `epoch`'s history. A population's per-member
    metric arrays are made read-only first: the State's metrics, its history and a run
    resumed from it hold the same arrays, so an in-place edit of one run's table would
    change another's."""
    freeze_arrays(state.metrics)
    return state.replace(history={**state.history, epoch: dict(state.metrics)})


def freeze_arrays(*tables: Any) -> None:
    """Makes the numpy arrays among the values of metric `tables` read-only (a loaded
    State's too: a run resumed from it holds its history's arrays)."""
    for table in tables:
        for value in (table or {}).values():
            if isinstance(value, np.ndarray):
                value.setflags(write=False)


def records_of(state: State) -> tuple[dict[str, Any], dict[str, Any]]:
    """What an epoch-end handler may write into in place: the State's metrics and its
    epoch's history entry (shallow copies, to compare with after the handler)."""
    return dict(state.metrics), dict(state.history.get(state.epoch) or {})


def written_in_place(state: State, records: tuple[dict[str, Any], dict[str, Any]]) -> Any:
    """`state` with what a handler wrote into `state.metrics` or `state.history[epoch]` in
    place taken as a returned `state.replace(metrics=...)` would be (metrics and history
    agree), or None where it wrote nothing."""
    metrics, entry = records
    now = state.history.get(state.epoch) or {}
    written = {k: v for k, v in now.items() if k not in entry or entry[k] is not v}
    changed = metrics.keys() != state.metrics.keys() or any(
        state.metrics[k] is not v for k, v in metrics.items()
    )
    if not written and not changed:
        return None
    return state.replace(metrics={**state.metrics, **written})
