"""How variables a user gave differ from the ones the model makes, in one sentence for an
error message."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["UNWRAPPED", "first_difference"]

UNWRAPPED = (
    " The given variables are the model's variables['params'] alone: pass the whole "
    "variables (state.params, the dict holding 'params' and any other collection) or the State."
)


def first_difference(given: Any, fresh: Any) -> str:
    """' The given variables hold <path> of shape (a) where the model makes (b).', or ''."""
    try:
        mine = dict(jax.tree_util.tree_flatten_with_path(given)[0])
        theirs = dict(jax.tree_util.tree_flatten_with_path(fresh)[0])
    except Exception:  # noqa: BLE001 - a description only
        return ""
    if isinstance(fresh, dict) and isinstance(given, dict) and "params" not in given:
        inner = dict(jax.tree_util.tree_flatten_with_path(fresh.get("params", {}))[0])
        if inner and inner.keys() == mine.keys():
            return UNWRAPPED
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
