"""Checks of the flax.nnx adapter (`_nnx.py`): what a given module or its variables hold
that a trainer would otherwise take silently."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._data_flow import passed_on
from ._linen import NNX_MODE_FLAGS, ModelConventionError

__all__ = [
    "count_values",
    "eval_flags",
    "handed_back",
    "param_values",
    "raw_value",
    "refuse_eval_draws",
    "refuse_other_shapes",
    "refuse_param_writes",
    "refuse_sown_before",
    "refuse_sown_weights",
    "rng_counts",
]


def eval_flags(module: Any) -> list[str]:
    """`path.flag=value` for each mode flag of `module`'s flax layers (Dropout, BatchNorm,
    attention, ...) that holds its evaluation value while another layer's holds its training
    value: a layer set by hand (a BatchNorm frozen for fine-tuning), which a trainer's
    `module.train()` would override. A module wholly in evaluation mode (`.eval()`, or
    `fl.models.trained`'s) is not listed: a trainer is expected to switch it. Nor are a
    user's own modules' flags (`self.training = False` until a trainer switches it on)."""
    from flax import nnx

    held, training = [], False
    for path, sub in nnx.iter_graph(module):
        if not isinstance(sub, nnx.Module) or not type(sub).__module__.startswith("flax."):
            continue
        for name, train_value in NNX_MODE_FLAGS.items():
            value = getattr(sub, name, None)
            if isinstance(value, bool) and value != train_value:
                held.append(".".join([*map(str, path), name]) + f"={value}")
            training = training or value is train_value
    return held if training else []


def refuse_other_shapes(module_values: Any, given: Any, part: str) -> None:
    """A ModelConventionError (a ValueError) naming the given variables whose shapes are
    not the module's own (a head of another width loaded from a checkpoint), which nnx
    would take as they are."""
    own = dict(jax.tree_util.tree_flatten_with_path(module_values)[0])
    wrong = [
        f"{part}{jax.tree_util.keystr(path)}: {np.shape(leaf)} given, "
        f"{np.shape(own[path])} in the module"
        for path, leaf in jax.tree_util.tree_flatten_with_path(given)[0]
        # A Variable may hold a plain number (a counter): np.shape reads it as ().
        if path in own and np.shape(leaf) != np.shape(own[path])
    ]
    if wrong:  # not a misfit of x, which the run's checks would say it is
        raise ModelConventionError(
            f"variables: shapes differ from the nnx module's own ({'; '.join(wrong[:4])}"
            f"{'; ...' if len(wrong) > 4 else ''}). Variables saved from a module of other "
            f"shapes do not fit it: give them to a module built as they were, or keep the "
            f"module's own value for each layer that changed (e.g. a new head) and load "
            f"the rest"
        )


def refuse_param_writes(
    given: dict[Any, Any], now: dict[Any, Any], passed_on: Callable[[], set[Any]]
) -> None:
    """A ModelConventionError naming the Params the module's training call wrote: a trainer
    changes params by their gradients alone and would drop the write, where nnx.Optimizer
    keeps it. A Param holding another value than it was given may hold the same one: one
    `passed_on()` names (asked only then) went through `nnx.remat` or `nnx.jit` unchanged."""
    written = [path for path, value in given.items() if now.get(path) is not value]
    written = _not_passed_on(written, passed_on)
    if written:
        names = ", ".join(".".join(str(key) for key in path) for path in written)
        raise ModelConventionError(
            f"model: its __call__ writes its own nnx.Param(s) ({names}), as a weight "
            f"constraint or nnx.SpectralNorm / nnx.WeightNorm do. A trainer changes params "
            f"by their gradients alone, so the write would be lost and training would differ "
            f"from an nnx.Optimizer loop. Keep the call from writing Params: use the "
            f"constrained weight in the computation without storing it, apply the constraint "
            f"after the optimizer's update in a step of your own (fl.loop; "
            f"optax.projections has common ones), or hold a value that is not trained in "
            f"another nnx.Variable (e.g. nnx.BatchStat)"
        )


def _not_passed_on(changed: list[Any], passed_on: Callable[[], set[Any]]) -> list[Any]:
    """`changed` (paths holding another value than before the call) less those `passed_on()`
    names: handed back unchanged by `nnx.remat` or `nnx.jit`. Asked only if any changed,
    as it traces the call once more."""
    if not changed:
        return changed
    kept = passed_on()
    return [path for path in changed if path not in kept]


def param_values(module: Any) -> dict[Any, Any]:
    """What each nnx.Param of `module` holds, by path (traced values: compared by identity)."""
    from flax import nnx

    nodes = nnx.iter_graph(module)
    return {path: raw_value(node) for path, node in nodes if isinstance(node, nnx.Param)}


def count_values(module: Any) -> dict[Any, Any]:
    """What each rng stream's count of `module` holds, by path."""
    return {path: count for path, (_, count) in rng_counts(module).items()}


def handed_back(
    variables: Any,
    merged: Callable[[Any], Any],
    call: Callable[[Any], Any],
    values: Callable[[Any], dict[Any, Any]],
) -> set[Any]:
    """The paths among `values(module)` that `call(module)`, on the module `merged` makes of
    `variables`, hands back unchanged though perhaps as new values: `nnx.remat` and
    `nnx.jit` write every Variable back (traced once more; read from the jaxpr)."""
    inputs: dict[Any, int] = {}  # each Variable's path: the index of its input leaf

    def traced(variables: Any) -> list[Any]:
        module = merged(variables)
        index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(variables))}
        inputs.update({path: index.get(id(v), -1) for path, v in values(module).items()})
        call(module)
        now = values(module)
        return [now.get(path, jnp.zeros(())) for path in inputs]  # one output each

    handed = passed_on(jax.make_jaxpr(traced)(variables))
    return {path for path, i in zip(inputs, handed, strict=True) if i == inputs[path]}


def rng_counts(module: Any) -> dict[Any, tuple[str, Any]]:
    """Each rng stream of `module` by path: its name and the value its count holds (a draw
    replaces the count's value, traced or not)."""
    from flax import nnx

    return {
        path: (str(getattr(node, "tag", path[-1])), raw_value(node.count))
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.RngStream)
    }


def refuse_eval_draws(
    before: dict[Any, tuple[str, Any]],
    after: dict[Any, tuple[str, Any]],
    module: Any,
    output_reads_draws: Callable[[], bool],
    passed_on: Callable[[], set[Any]],
) -> None:
    """A ModelConventionError naming the rng streams an evaluation call drew from and the
    layers that hold them, where its output reads what they drew (`output_reads_draws`,
    asked only then): an evaluation does not carry the module's Rngs from batch to batch
    (nor does linen's, which is given none), so every batch would draw the same numbers.
    A count `passed_on()` names went through `nnx.remat` or `nnx.jit` unchanged: nothing
    was drawn."""
    paths = [path for path, (_, count) in after.items() if count is not before.get(path, ("",))[-1]]
    paths = _not_passed_on(paths, passed_on)
    if not paths or not output_reads_draws():
        return
    drawn = sorted({after[path][0] for path in paths})
    holders = _holders(module, paths)
    flags = ", ".join(f"{name}={not value}" for name, value in NNX_MODE_FLAGS.items())
    recurrent = any(_holds_an_rnn(layer) for layer in holders.values())
    carry = (
        "; an nnx.RNN whose cell has a random carry_init draws its initial carry at every "
        "call: give the cell carry_init=nnx.initializers.zeros_init(), or pass initial_carry"
        if recurrent
        else ""
    )
    raise ModelConventionError(
        f"model: {type(module).__name__} draws from its rng stream(s) "
        f"{', '.join(map(repr, drawn))} in evaluation (validation, fl.evaluator, "
        f"fl.predict), after .eval(), in {' or '.join(sorted(holders))}. "
        f"Evaluation does not carry an nnx model's Rngs from one batch to the next, so "
        f"every batch would draw the same numbers{carry}. If a layer stays random because "
        f"__call__ passes it a mode flag of its own (e.g. nnx.Dropout(...)(x, "
        f"deterministic=eval_mode)), name that argument one fuseloop sets ({flags} in "
        f"evaluation) or let the layer follow the module's mode (.eval() turns nnx.Dropout "
        f"off); a model that samples on purpose in evaluation (MC dropout, a VAE's z) is "
        f"evaluated with a loop of your own"
    )


def _holders(module: Any, paths: list[tuple[Any, ...]]) -> dict[str, Any]:
    """`{"model.rnn (RNN)": the layer}` for each module that holds one of the rng streams
    at `paths`, itself or in its nnx.Rngs (a stream shared by several layers is on one
    path only, and which of them drew cannot be told: each is named)."""
    from flax import nnx

    nodes = dict(nnx.iter_graph(module))
    streams = {id(nodes[path]) for path in paths if path in nodes}
    found = {}
    for path, node in nodes.items():
        if not isinstance(node, nnx.Module):
            continue
        held = [v for v in vars(node).values() if isinstance(v, (nnx.Rngs, nnx.RngStream))]
        held += [s for rngs in held if isinstance(rngs, nnx.Rngs) for s in vars(rngs).values()]
        if any(id(value) in streams for value in held):
            found[f"{'.'.join(['model', *map(str, path)])} ({type(node).__name__})"] = node
    return found or {f"model ({type(module).__name__})": module}


def _holds_an_rnn(layer: Any) -> bool:
    """Whether `layer`, holding a drawing stream, is an nnx.RNN or an nnx.Bidirectional of
    two (a module of the user's holding an RNN may draw for its own ends)."""
    from flax import nnx

    return isinstance(layer, (nnx.RNN, getattr(nnx, "Bidirectional", nnx.RNN)))


def raw_value(variable: Any) -> Any:
    """What a Variable holds, without the checks of `.value` (None for what is no
    Variable). Newer flax reads it with `get_raw_value()` and deprecates `raw_value`."""
    get = getattr(variable, "get_raw_value", None)
    return get() if get is not None else getattr(variable, "raw_value", None)


def refuse_sown_before(held: set[Any], module: Any) -> None:
    """Refuses values an earlier call sowed (a shape check, `model(x)`, before the trainer
    took the module): held as the module's own, each training call would add to them."""
    from flax import nnx

    nodes = nnx.iter_graph(module)
    sown = [p for p, n in nodes if tuple(p) in held and isinstance(raw_value(n), tuple)]
    if sown:
        raise ModelConventionError(
            f"the nnx module holds what an earlier call sowed ({'.'.join(map(str, sown[0]))}, "
            f"an nnx.Intermediate), which a trainer would carry as state and add to at every "
            f"step: drop it before building the trainer, nnx.pop(model, nnx.Intermediate)"
        )


def refuse_sown_weights(module: Any, argument: str) -> None:
    """Refuses an nnx module given as weights (`argument`) that holds what a call sowed (a
    shape check, `model(x)`): an nnx.Intermediate is the call's output, no weight, and the
    module the run was built from has none of it. Anything else is left alone."""
    from flax import nnx

    if not isinstance(module, nnx.Module):
        return
    sown = [
        path
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Intermediate) and isinstance(raw_value(node), tuple)
    ]
    if sown:
        raise ModelConventionError(
            f"{argument}: the nnx module holds what an earlier call sowed "
            f"({'.'.join(map(str, sown[0]))}, an nnx.Intermediate), which is no weight: drop "
            f"it first, nnx.pop(module, nnx.Intermediate)"
        )
