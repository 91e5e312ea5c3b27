"""Whether an nnx or equinox module that `fl.models.trained` made evaluating was since put
in training mode by its library's own switch: nnx's `.train()` (a Dropout's
`deterministic`, a BatchNorm's `use_running_average`, a recognised flag a module keeps as
a plain bool), equinox's `eqx.nn.inference_mode(m, False)` (every `inference` field)."""

from __future__ import annotations

from typing import Any

import jax

from ._linen import NNX_MODE_FLAGS

__all__ = ["switched_to_training"]


def switched_to_training(module: Any) -> bool:
    """Whether some layer of `module` holds its training-mode value (`trained` left every
    one in evaluation mode)."""
    from flax import nnx

    if isinstance(module, nnx.Module):
        return any(
            getattr(sub, name, None) is train_value
            for _, sub in nnx.iter_graph(module)
            if isinstance(sub, nnx.Module)
            for name, train_value in NNX_MODE_FLAGS.items()
        )
    fields = jax.tree_util.tree_flatten_with_path(module)[0]
    return any(
        value is False and path and getattr(path[-1], "name", None) == "inference"
        for path, value in fields
    )
