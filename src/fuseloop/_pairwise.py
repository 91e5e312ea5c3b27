"""`fl.pairwise`: a loss or metric that compares every target with every prediction on
purpose, exempt from the check for an accidental cross broadcast (`_target_shapes`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["is_pairwise", "pairwise"]

_MARK = "__fuseloop_pairwise__"


def pairwise(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Marks `fn(y_true, y_pred)` as comparing every target with every prediction on
    purpose: a retrieval score, a contrastive loss between predicted and target embeddings.

    fuseloop refuses a loss or metric that broadcasts a value computed from the targets
    against one computed from the outputs across examples (a (B, 1) output minus (B,)
    targets makes (B, B), the classic silent bug); `fl.pairwise(fn)` lets such a function
    run as written. Its per-example values must still hold the batch first.

    Args:
        fn: The loss or metric, `fn(y_true, y_pred)`.

    Returns:
        `fn`, marked (a wrapper with its name and signature).

    Example:
        >>> import fuseloop as fl, jax.numpy as jnp
        >>> def retrieval_at_1(y_true, y_pred):  # the nearest target is the example's own
        ...     distance = jnp.sum((y_pred[:, None, :] - y_true[None, :, :]) ** 2, -1)
        ...     return jnp.argmin(distance, -1) == jnp.arange(len(y_true))
        >>> loop = fl.trainer(fl.models.mlp([4]), "mean_squared_error", "sgd")
        >>> loop = loop.metric(fl.pairwise(retrieval_at_1))
        >>> [m.name for m in loop.metrics][-1]
        'retrieval_at_1'
    """
    if not callable(fn):
        raise TypeError(f"fl.pairwise(fn): fn={fn!r} is not a callable(y_true, y_pred)")

    @functools.wraps(fn)
    def marked(y_true: Any, y_pred: Any) -> Any:
        return fn(y_true, y_pred)

    setattr(marked, _MARK, True)
    return marked


def is_pairwise(fn: Any) -> bool:
    """Whether `fn` was marked by `pairwise`."""
    return getattr(fn, _MARK, False) is True
