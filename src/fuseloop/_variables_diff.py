"""How variables a user gave differ from the ones the model makes: the sentence an error
message adds, and warnings of a resumed State's other dtypes and of variables the model
never reads."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ._warn import warn

__all__ = [
    "UNWRAPPED",
    "first_difference",
    "is_nnx_state",
    "member_axis",
    "names_the_form",
    "same_signature",
    "warn_other_dtype",
    "warn_unread",
]

UNWRAPPED = (
    " The given variables are the model's variables['params'] alone: pass the whole "
    "variables (state.params, the dict holding 'params' and any other collection) or the State."
)
NNX_STATE = (
    " The given variables are an nnx.State (nnx.state(module), as orbax restores it), which"
    " fuseloop does not read as an nnx model's variables: load it into the module"
    " (nnx.update(module, state)) and pass the module itself as the variables (a trainer's"
    " run may leave them out: it starts from the module's weights as they are then)."
)
WRAPPED = (
    " The given variables hold the model's own under 'params' (flax's wrapper), which this"
    " model's init does not make: pass variables['params'], shaped as its init returns them."
)
_MEMBERS = " These variables have a leading axis of"
# Sentences that say the variables are given in a form fuseloop does not read: x is not
# the problem, whatever the model said.
NOT_X = (UNWRAPPED, WRAPPED, NNX_STATE)


def same_signature(a: Any, b: Any) -> bool:
    """Whether two (abstract) variable trees have the same structure, shapes and dtypes."""
    leaves_a, treedef_a = jax.tree.flatten(a)
    leaves_b, treedef_b = jax.tree.flatten(b)
    expected: object = treedef_a  # this jaxlib has no stub for PyTreeDef: compare as objects
    return expected == treedef_b and all(
        (np.shape(x), getattr(x, "dtype", type(x))) == (np.shape(y), getattr(y, "dtype", type(y)))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def names_the_form(difference: str) -> bool:
    """Whether `first_difference`'s sentence says the variables are given in a form
    fuseloop does not read (x is then not the problem, whatever the model said)."""
    return difference in NOT_X or difference.startswith(_MEMBERS)


def member_axis(variables: Any, fresh: Any) -> int | None:
    """N where every leaf of `variables` is the model's fresh leaf with a leading axis of
    N (a population's params given without their State), else None."""
    expected: object = jax.tree.structure(fresh)  # no stub for PyTreeDef: compare as objects
    if expected != jax.tree.structure(variables):
        return None
    sizes = set()
    for leaf, own in zip(jax.tree.leaves(variables), jax.tree.leaves(fresh), strict=True):
        shape = tuple(np.shape(leaf))
        if shape[1:] != tuple(np.shape(own)) or len(shape) != np.ndim(own) + 1:
            return None
        sizes.add(shape[0])
    return sizes.pop() if len(sizes) == 1 else None


def is_nnx_state(tree: Any) -> bool:
    """Whether `tree` is an `nnx.State` (flax.nnx is imported wherever an nnx model is)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(tree, nnx.State)


def first_difference(given: Any, fresh: Any) -> str:
    """' The given variables hold <path> of shape (a) where the model makes (b).', or ''."""
    if is_nnx_state(given):
        return NNX_STATE
    size = member_axis(given, fresh)
    if size is not None:
        return (
            f"{_MEMBERS} {size} over the model's own (a population's params, one per "
            f"member): pass the population's State itself (an evaluator's run takes it with "
            f"population={size}: run(data, state, population={size})), or state.member(i) "
            f"for one member."
        )
    try:
        mine = dict(jax.tree_util.tree_flatten_with_path(given)[0])
        theirs = dict(jax.tree_util.tree_flatten_with_path(fresh)[0])
    except Exception:  # noqa: BLE001 - a description only
        return ""
    if isinstance(fresh, dict) and isinstance(given, dict) and "params" not in given:
        inner = dict(jax.tree_util.tree_flatten_with_path(fresh.get("params", {}))[0])
        if inner and inner.keys() == mine.keys():
            return UNWRAPPED
    if isinstance(given, dict) and given.keys() == {"params"} and isinstance(fresh, dict):
        inner = dict(jax.tree_util.tree_flatten_with_path(given["params"])[0])
        if "params" not in fresh and inner and inner.keys() == theirs.keys():
            return WRAPPED
    for path in sorted(mine.keys() | theirs.keys(), key=str):
        name = jax.tree_util.keystr(path)
        if path not in theirs:
            return f" The given variables hold {name}, which the model does not make."
        if path not in mine:
            return f" The given variables lack {name}, which the model makes."
        if np.shape(mine[path]) != np.shape(theirs[path]):
            return (
                f" The given variables hold {name} of shape {tuple(np.shape(mine[path]))} "
                f"where the model makes {tuple(np.shape(theirs[path]))}."
            )
    return ""


def refuse_narrowed_state(step_state: Any) -> None:
    """Refuses a resumed State's step state holding 64-bit jax arrays while JAX's 64-bit
    mode is off (a State of a run under x64, continued after it was turned off): they would
    be narrowed to 32 bits, as `fl.load_state` refuses to load them. Host (numpy) leaves
    are narrowed as a fresh run's variables are: only x64 makes a 64-bit jax array."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(step_state)[0]:
        dtype = getattr(leaf, "dtype", None)
        if not isinstance(leaf, jax.Array) or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            continue  # a typed PRNG key (jax.random.key) has no numpy dtype, nor 64 bits
        if np.dtype(dtype).kind not in "fiuc":
            continue
        if jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise ValueError(
                f"init_state: the State holds step_state{jax.tree_util.keystr(path)} as "
                f"{dtype}, made in JAX's 64-bit mode, which is off now: continued, it would "
                f"be narrowed to 32 bits. Turn the mode on to continue it "
                f"(jax.config.update('jax_enable_x64', True)), or start from its params "
                f"cast to 32 bits with a fresh optimizer state"
            )


def warn_other_dtype(given: Any, fresh: Any) -> None:
    """Warns where a resumed State holds a param in another dtype than the model makes it
    (a bfloat16 State resumed by a model now built with float32 params): the run goes on
    training in the State's dtype, not the one the model declares. A hand-written loop does
    the same; Keras and PyTorch cast loaded weights to the model's dtype instead. It is not
    an error: the State may come from variables cast on purpose (a linen model trained in
    bfloat16 by casting its float32 variables, as Hugging Face's `to_bf16` does), whose
    resume this is. Only the trained variables ('params' where the variables hold that
    collection) are compared: a step may keep other collections in another dtype than init
    made them (batch statistics of float64 inputs), and the step's own check says where it
    changes one.
    """
    within = ""
    if isinstance(given, dict) and isinstance(fresh, dict) and "params" in fresh:
        given, fresh, within = given.get("params", {}), fresh["params"], "['params']"
    try:
        theirs = dict(jax.tree_util.tree_flatten_with_path(fresh)[0])
        mine = jax.tree_util.tree_flatten_with_path(given)[0]
    except Exception:  # noqa: BLE001 - a structure the fit check already judged
        return
    for path, leaf in mine:
        made: Any = theirs.get(path)
        if not (hasattr(leaf, "dtype") and hasattr(made, "dtype")):
            continue
        # (A host float64 leaf while 64-bit mode is off trains narrowed: no other dtype.)
        extended = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
        trained_in = leaf.dtype if extended else jax.dtypes.canonicalize_dtype(leaf.dtype)
        if trained_in != made.dtype and np.shape(leaf) == np.shape(made):
            cast = (
                f"jax.tree.map(lambda a: a.astype(jnp.{made.dtype}) if a.dtype == "
                f"jnp.{leaf.dtype} else a, state.params)"
            )
            warn(
                f"init_state: the State holds {within}{jax.tree_util.keystr(path)} as "
                f"{leaf.dtype} where the model makes it {made.dtype}, so the resumed run "
                f"trains it in {leaf.dtype}, as the State was trained, not in the dtype the "
                f"model declares. If the model's dtype changed since the State was saved, "
                f"resume with the model built as it was (e.g. its param_dtype), or start from "
                f"its weights cast to the model's dtypes, with a fresh optimizer state: "
                f"trainer.run(data, {cast})",
                RuntimeWarning,
            )
            return


def warn_unread(given: Any, fresh: Any) -> None:
    """Warns where a trainer's given variables hold arrays its model does not make.

    flax ignores them, so a checkpoint of a larger model (a head this one drops) runs; but
    they are carried as trained variables: the optimizer keeps state for them, a weight
    decay shrinks them, and `state.params` returns them.
    """
    try:
        mine = [path for path, _ in jax.tree_util.tree_flatten_with_path(given)[0]]
        theirs = {path for path, _ in jax.tree_util.tree_flatten_with_path(fresh)[0]}
    except Exception:  # noqa: BLE001 - a structure the fit check already judged
        return
    unread = [path for path in mine if path not in theirs]
    if unread:
        extra = [jax.tree_util.keystr(path) for path in unread]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        # A collection beside a linen model's 'params' is carried, not trained.
        trained = not isinstance(given, Mapping) or "params" not in given
        trained = trained or any(getattr(path[0], "key", None) == "params" for path in unread)
        carried = (
            ", but the run carries them as variables: the optimizer keeps state for them, a "
            "weight decay shrinks them, and state.params returns them"
            if trained
            else "; the run carries them unchanged (they are not trained), and state.params "
            "returns them"
        )
        warn(
            f"model: the given variables hold {extra[0]}{more}, which the model does not "
            f"make. The model never reads them{carried}. Pass only the variables the model "
            f"makes (e.g. drop the old head's entries from a checkpoint)"
        )
