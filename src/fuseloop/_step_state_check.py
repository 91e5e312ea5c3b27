"""One step keeps the step state's structure, dtypes and shapes (found abstractly).

The fused and the unfused loop carry the step state through a device loop, which needs it
unchanged from step to step; a change is an error naming the leaf and the fix before
anything compiles, rather than a message from deep inside JAX.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._epoch_order import abstract_key, prng_impl
from ._model_fit import abstract
from ._step import _trainable

__all__ = [
    "check_optimizer_fits",
    "check_step_keeps_state",
    "explain_step_change",
    "refuse_returned_layout",
]


def _state_leaf(leaf: Any) -> Any:
    """The abstract value of a step-state leaf as the device loop carries it."""
    return jax.ShapeDtypeStruct(
        np.shape(leaf), jax.dtypes.canonicalize_dtype(jnp.result_type(leaf))
    )


_CAST_FIX = (
    "Cast the result back (e.g. .astype(old dtype)), or build the state (e.g. the optimizer "
    "state) in the dtype the step produces"
)
_OPTIMIZER_FIX = (
    "The optimizer keeps this part of its state in the params' dtype and promotes it in its "
    "update (optax does so for bfloat16 params): give the trainer a named optimizer "
    "('sgd', 'adam', 'adamw'; their state is kept in float32), or keep the params in "
    "float32 (a layer's param_dtype) and compute in bfloat16 (its dtype)"
)


def _collection(path: Any, step_state: Any) -> str | None:
    """The model collection (not "params") a step-state leaf is in, if any: a trainer's
    `step_state["params"]` holds all of a flax.linen model's variables, collections beside
    "params" (a custom loop's `step_state["params"]` without a "params" entry of its own
    holds plain weights, not collections)."""
    keys = [getattr(entry, "key", None) for entry in path[:2]]
    if keys[0] != "params" or keys[1] in (None, "params"):
        return None
    variables = step_state.get("params") if isinstance(step_state, dict) else None
    return keys[1] if isinstance(variables, Mapping) and "params" in variables else None


def _fix_for(path: Any, old: Any, new: Any, step_state: Any) -> str:
    """What to do about a leaf whose dtype one step changes from `old` to `new`."""
    if jax.dtypes.issubdtype(new, jax.dtypes.extended):  # a raw key made a typed one
        return (
            "The step returns a typed PRNG key where it was given raw key data: return "
            "jax.random.key_data(key), or start from a typed key (jax.random.key(seed))"
        )
    if _in_optimizer_state(path):
        return _OPTIMIZER_FIX
    name = _collection(path, step_state)
    if name is None or old == new:
        return _CAST_FIX
    if name != "batch_stats":  # a collection the model's own code writes
        return (
            f"The leaf is in the model's {name!r} collection, which its init makes in {old} "
            f"and its step writes in {new}: cast the update back where the model writes it "
            f"(e.g. value.astype({str(old)!r})), or create the variable in {new}"
        )
    return (
        f"The leaf is in the model's {name!r} collection, which its init makes in {old} and "
        f"its step in {new} (flax's BatchNorm starts its statistics in float32, and float64 "
        f"inputs under jax_enable_x64 make them float64). Give the model x in {old}, or "
        f"start from variables whose {name!r} is {new} already: variables = "
        f"model.init(key, x), with variables[{name!r}] replaced by jax.tree.map(lambda a: "
        f"a.astype({str(new)!r}), variables[{name!r}]), then loop.run(data, variables)"
    )


def _in_optimizer_state(path: Any) -> bool:
    """Whether a step-state leaf's path is in a trainer's optimizer state."""
    return bool(path) and getattr(path[0], "key", None) == "opt_state"


def _kinds_apart(held: Any, made: Any) -> tuple[str, str]:
    """The optax state types of two optimizer states, each once where that tells them
    apart, else with how often each occurs (adam's against adamw's: "EmptyState x2"),
    else the same kinds said to be nested otherwise (the paths apart name where)."""
    for counted in (False, True):
        pair = _state_kinds(held, counted), _state_kinds(made, counted)
        if pair[0] != pair[1]:
            return pair
    return pair[0], f"{pair[1]}, nested otherwise"


def _state_kinds(opt_state: Any, counted: bool = False) -> str:
    """The optax state types in an optimizer state, outermost first, e.g.
    "InjectStatefulHyperparamsState, ScaleByAdamState, EmptyState" (`counted`: with how
    often each occurs where more than once, "EmptyState x2")."""
    found: dict[str, int] = {}

    def walk(node: Any) -> None:
        if hasattr(node, "_fields"):
            found[type(node).__name__] = found.get(type(node).__name__, 0) + 1
            children: Any = tuple(node)
        elif isinstance(node, dict):
            children = tuple(node.values())
        elif isinstance(node, (list, tuple)):
            children = tuple(node)
        else:
            return
        for child in children:
            walk(child)

    walk(opt_state)
    named = (f"{kind} x{n}" if counted and n > 1 else kind for kind, n in found.items())
    return ", ".join(named) or "no optax state"


_TRAINER_KEYS = ("opt_state", "rng", "step")  # beside "params" (`_step.trainer_program`)


def _check_key_kind(rng: Any) -> None:
    """A ValueError where a trainer's key (raw key data) was made under a PRNG kind whose
    keys have another size than the one in force: JAX's own error names no fix."""
    typed = jax.dtypes.issubdtype(getattr(rng, "dtype", np.uint32), jax.dtypes.prng_key)
    words, want = np.shape(rng)[-1:], abstract_key().shape
    if not typed and words != want:  # a typed key carries its kind: JAX says what differs
        raise ValueError(
            f"init_state: its step state's key holds {words[0] if words else 0} words, made "
            f"under another PRNG kind than this run's jax_default_prng_impl "
            f"({prng_impl()!r}, keys of {want[0]}): resume under the kind it was saved with "
            f"(threefry2x32, JAX's default, makes keys of 2 words; rbg and unsafe_rbg of 4)"
        )


def check_optimizer_fits(optimizer: Any, step_state: Any) -> None:
    """Raises a ValueError where a trainer's step state lacks what a trainer's holds (an
    evaluator's State: params alone; a custom loop's: no params) or holds an optimizer
    state of another structure than `optimizer` makes (a State resumed with another
    optimizer), either of which would otherwise fail inside the step or optax (found
    abstractly: nothing runs).
    """
    if optimizer is None or not isinstance(step_state, dict):
        return
    missing = [key for key in ("params", *_TRAINER_KEYS) if key not in step_state]
    if missing:
        start = (
            "Start this trainer from its params, loop.run(data, state.params, ...)"
            if "params" in step_state
            else "Start this trainer afresh, loop.run(data), or from a model's variables"
        )
        raise ValueError(
            f"init_state: its step state holds {sorted(map(str, step_state))}, not the "
            f"{', '.join(missing)} a trainer's holds (the State of an evaluator, or of a loop "
            f"of your own?). {start}, or resume from a State a trainer made"
        )
    _check_key_kind(step_state["rng"])
    if "opt_state" not in step_state:
        return
    trainable, _ = _trainable(step_state["params"])  # what the trainer's init gives tx.init
    try:
        made = jax.eval_shape(optimizer.init, jax.tree.map(_state_leaf, trainable))
    except Exception:  # noqa: BLE001 - an init that cannot run abstractly: the run decides
        return
    held = step_state["opt_state"]
    expected: object = jax.tree.structure(made)  # no stub for PyTreeDef: compare as objects
    if expected != jax.tree.structure(held):
        held_kinds, made_kinds = _kinds_apart(held, made)
        raise ValueError(
            f"init_state: its optimizer state ({held_kinds}) is not the one this "
            f"trainer's optimizer makes ({made_kinds}){_paths_apart(held, made)}: "
            f"the State was trained with another optimizer. Resume with the optimizer it "
            f"was trained with, or start this one afresh from its params: "
            f"loop.run(data, state.params, ...)"
        )


def _paths_apart(held: Any, made: Any) -> str:
    """Where two optimizer states of the same kinds differ (adam's and adamw's: a
    `weight_decay` hyperparameter), as `; <path> only in ...`; empty if nothing names it."""

    flat = jax.tree_util.tree_flatten_with_path
    only_made, only_held = _paths_only_in(flat(made)[0], flat(held)[0])
    apart = [f"opt_state{p} only in this optimizer's" for p in only_made]
    apart += [f"opt_state{p} only in the State's" for p in only_held]
    return "; " + ", ".join(apart) if apart else ""


def _paths_only_in(first: list[Any], second: list[Any]) -> tuple[list[str], list[str]]:
    """Up to two leaf paths (`keystr`) of flattened-with-path `first` that `second` lacks,
    and up to two of `second` that `first` lacks, in order."""
    a = [jax.tree_util.keystr(path) for path, _ in first]
    b = [jax.tree_util.keystr(path) for path, _ in second]
    in_a, in_b = set(a), set(b)
    return [p for p in a if p not in in_b][:2], [p for p in b if p not in in_a][:2]


def structure_change(old: list[Any], new: list[Any]) -> str:
    """The first leaf paths one step adds or drops, and what a sown value's growth means."""
    added, gone = _paths_only_in(new, old)
    parts = [f"step_state{p} appears after one step" for p in added]
    parts += [f"step_state{p} is gone after one step" for p in gone]
    said = "; ".join(parts) or "its containers change type (e.g. a tuple becomes a list)"
    # flax's default reduce appends a sown value to a tuple: its second element appears.
    sown = ("'losses'", "'intermediates'")
    if any(p.endswith("[1]") or any(c in p for c in sown) for p in added + gone):
        said += (
            " (a value the model sows each step, which flax's default reduce appends: "
            "give self.sow an init_fn and a reduce_fn that keep one value, or write the step "
            "with fl.loop; fuseloop's trainer does not add sown losses to its objective)"
        )
    if any(p.startswith("['params']['state']") for p in added):  # an nnx module's rest
        said += (
            " (an nnx module that makes a Variable in its call that it did not hold before, "
            "as self.sow(VariableType, ...) does for a type other than nnx.Intermediate: "
            "make the Variable in __init__, e.g. self.total = VariableType(jnp.zeros(())), "
            "and give self.sow an init_fn and a reduce_fn that keep one value (its default "
            "appends to a tuple), or sow into nnx.Intermediate, which fuseloop drops as an "
            "output of the call)"
        )
    return said


def check_step_keeps_state(step: Any, step_state: Any, batch: Any) -> None:
    """Raises a ValueError if one step changes the step state's structure, or a leaf's
    dtype or shape (found abstractly with `jax.eval_shape`: nothing runs or compiles).

    The fused and the unfused loop carry the step state through a device loop, which needs
    it unchanged; an optimizer state that promotes bfloat16 to float32 would otherwise fail
    deep inside JAX. A step that cannot be evaluated abstractly is left to the run itself.
    """
    try:
        before = jax.tree.map(_state_leaf, step_state)
        after = jax.eval_shape(lambda s, b: step(s, b)[0], before, jax.tree.map(abstract, batch))
    except Exception:  # noqa: BLE001 - the run raises its own, more specific error
        return
    old, old_def = jax.tree_util.tree_flatten_with_path(before)
    new, new_def = jax.tree_util.tree_flatten_with_path(after)
    expected: object = old_def  # this jaxlib has no stub for PyTreeDef: compare as objects
    if expected != new_def:
        raise ValueError(
            f"the step changes the structure of the step state: "
            f"{structure_change(old, new)}. A step must return a state with the same "
            f"structure, dtypes and shapes it was given"
        )
    for (path, a), (_, b) in zip(old, new, strict=True):
        if (a.shape, a.dtype) != (b.shape, _canonical(b.dtype)):
            raise ValueError(
                f"the step changes step_state{jax.tree_util.keystr(path)} from dtype "
                f"{a.dtype} shape {a.shape} to dtype {b.dtype} shape {b.shape}; a step must "
                f"keep every leaf's dtype and shape (the loop carries the state through a "
                f"device loop). " + _fix_for(path, a.dtype, b.dtype, before) + _numbers(batch)
            )


def _numbers(batch: Any) -> str:
    """Where the batch holds a number (a per-batch weight), how it arrives: an array of a
    dtype of its own, which promotes a narrower state leaf jax.jit's weak Python number
    would not."""
    if not any(np.ndim(leaf) == 0 for leaf in jax.tree.leaves(batch)):
        return ""
    return (
        ". A number in the batch (a per-batch weight) arrives as an array of its dtype "
        "(float32 or int32 for a Python number), not weakly typed as jax.jit takes a Python "
        "number argument: cast it in the step (e.g. w.astype(leaf.dtype)) or give it in the "
        "state's dtype"
    )


def _canonical(dtype: Any) -> Any:
    """`dtype` as the device holds it (float64 as float32 without x64); a typed key's
    extended dtype is its own."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def explain_step_change(step: Any, signature: Any, batch: Any) -> ValueError | None:
    """`check_step_keeps_state`'s error for a step state of `signature`, `(treedef,
    ((shape, dtype), ...))`, or None where one step keeps that state (found abstractly)."""
    treedef, spec = signature
    state = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in spec])
    try:
        check_step_keeps_state(step, state, batch)
    except ValueError as found:
        return found
    return None


def refuse_returned_layout(before: Any, after: Any, subject: str) -> None:
    """Refuses a built-in step's state a handler returned in another structure, or with a
    float param turned int or bool (a bias set to `jnp.array([0, 0, 0])` failed later
    inside jax.grad, naming neither). Shapes, other float dtypes (a cast to bfloat16 on
    purpose) and the optimizer state's numbers (a learning rate set to 0, which optax
    takes as it is) are the step's own checks' to judge. `subject` names the step state
    and who handed it back (returned, or written into in place), for the message.
    """
    expected: object = jax.tree.structure(before)  # no stub for PyTreeDef: compare as objects
    if expected != jax.tree.structure(after):
        old_paths, new_paths = _paths(before), _paths(after)
        added, missing = sorted(new_paths - old_paths)[:3], sorted(old_paths - new_paths)[:3]
        problem = (
            f"adds {', '.join(added) or 'nothing'} and lacks {', '.join(missing) or 'nothing'}"
            if added or missing
            else "has other containers (a dict in place of a NamedTuple, say)"
        )
        raise ValueError(
            f"{subject} {problem}: the compiled step takes a step state of the "
            f"structure it was given. Change values only "
            f"(keep every key); keep anything else of your own in handler_metadata"
        )
    if not (isinstance(after, Mapping) and isinstance(before, Mapping) and "params" in before):
        return
    old_leaves, new_leaves = jax.tree.leaves(before["params"]), jax.tree.leaves(after["params"])
    for i, (new, old) in enumerate(zip(new_leaves, old_leaves, strict=True)):
        was, now = getattr(old, "dtype", None), getattr(new, "dtype", None)
        if was is None or now is None or was == now:
            continue  # a leaf no device holds is named by the run's placement
        if jnp.issubdtype(was, jnp.inexact) and not jnp.issubdtype(now, jnp.inexact):
            path = jax.tree_util.tree_flatten_with_path(after["params"])[0][i][0]  # only now
            raise ValueError(
                f"{subject}['params']{jax.tree_util.keystr(path)} is {now} where the step "
                f"gave {was}: a parameter the loop differentiates cannot become an int or "
                f"bool; build it as a float, e.g. jnp.zeros_like(old) or "
                f"jnp.asarray(new, old.dtype)"
            )


def _paths(tree: Any) -> set[str]:
    return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
