"""Which of an optimizer's injected hyperparameters its update recomputes (a schedule).

`optax.inject_hyperparams` keeps hyperparameters in the optimizer state, where
`reduce_lr_on_plateau` and a population write theirs; a hyperparameter given as a schedule
is recomputed at every update and would overwrite what was written, silently. One update
on a tiny probe finds them: each injected value is set to a marker, and a schedule replaces
its marker. The probe passes what a trainer's update passes (`_optim.optimizer_update`),
and looks through `optax.MultiSteps` (whose accumulating updates leave the inner state
alone) to the optimizer it applies; one nested in a chain or a group is updated until it
has applied its inner update once.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._optim import optimizer_update
from ._rate_groups import inject_states, is_inject_state

__all__ = ["rate_is_scheduled", "scheduled_hyperparams"]

_MARKER = 0.123456789


def scheduled_hyperparams(
    tx: Any, params: Any = None, compiled: bool = False
) -> frozenset[str] | None:
    """The names of `tx`'s injected hyperparameters that an update recomputes, probed on
    `params` (default: a tiny stand-in); None when the probe cannot run (an optimizer whose
    structure depends on the params, probed without them). `compiled`: the probe runs as
    one jitted program rather than op by op (a model's params: one compile rather than an
    eager dispatch of every op of the update on every leaf).

    Example:
        >>> import optax
        >>> sched = optax.linear_schedule(1e-3, 0.0, 100)
        >>> sorted(scheduled_hyperparams(optax.inject_hyperparams(optax.adam)(sched)))
        ['learning_rate']
        >>> sorted(scheduled_hyperparams(optax.inject_hyperparams(optax.adam)(1e-3)))
        []
    """
    tx = _applying(tx)
    if params is None:
        params = {"w": jnp.zeros((1,), jnp.float32)}
    init: Any = functools.partial(_marked_init, tx)
    update: Any = functools.partial(_update, tx)
    try:
        marked = (jax.jit(init) if compiled else init)(params)
        if _multi_steps(marked):
            # An optax.MultiSteps inside the optimizer (a chain's or a group's) applies its
            # inner update, where a schedule rewrites its value, only every k-th update:
            # updated on the device until each one has applied once.
            after, applied = _applied_by_either(tx, marked, params)
            if not applied:
                return None  # some never applied within the cap: nothing can be told
        else:
            after = (jax.jit(update) if compiled else update)(marked, params)
    except Exception:  # noqa: BLE001 - structure-dependent optimizers cannot be probed
        return None
    changed: set[str] = set()
    for before, now in zip(inject_states(marked), inject_states(after), strict=False):
        for name, value in before.hyperparams.items():
            if name in now.hyperparams and not np.array_equal(
                np.asarray(value), np.asarray(now.hyperparams[name])
            ):
                changed.add(name)
    return frozenset(changed)


def _marked_init(tx: Any, params: Any) -> Any:
    """`tx`'s state with a marker in every injected hyperparameter."""
    return jax.tree.map(_mark, tx.init(params), is_leaf=is_inject_state)


# The probe's gradient, in every floating leaf: small (a MultiSteps' should_skip_update_fn
# that skips large updates takes it) but not zero (nor does one that skips zero gradients,
# where the probe would never see its inner update apply), and a normal float16 number.
_PROBE_GRADIENT = 1e-4


def _gradient(leaf: Any, small: bool = True) -> Any:
    if small and jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.full_like(leaf, _PROBE_GRADIENT)
    return jnp.zeros_like(leaf)


def _update(tx: Any, state: Any, params: Any, small: bool = True) -> Any:
    """`state` after one update of small gradients (`_PROBE_GRADIENT`; zeros where not
    `small`), passed as a trainer's update passes them."""
    _, after = optimizer_update(
        tx,
        jax.tree.map(functools.partial(_gradient, small=small), params),
        state,
        params,
        jnp.zeros((), jnp.float32),
        lambda p: jnp.zeros((), jnp.float32),
    )
    return after


_MOST_ACCUMULATED = 1 << 16  # updates a nested MultiSteps may take before it applies


def _multi_steps(state: Any) -> list[Any]:
    """The `optax.MultiSteps` states inside `state`, those nested in another's included."""
    is_multi = lambda node: isinstance(node, optax.MultiStepsState)  # noqa: E731
    found = []
    for node in jax.tree.leaves(state, is_leaf=is_multi):
        if is_multi(node):
            found += [node, *_multi_steps(node.inner_opt_state)]
    return found


def _applied_by_either(tx: Any, state: Any, params: Any) -> tuple[Any, Any]:
    """`_until_applied` with small gradients, or where some MultiSteps never applied them
    (a `should_skip_update_fn` that skips a large norm: a large model's small gradients
    add up to one), with zero gradients."""
    for small in (True, False):
        after, applied = jax.jit(functools.partial(_until_applied, tx, small=small))(state, params)
        if applied:
            break
    return after, applied


def _until_applied(tx: Any, state: Any, params: Any, small: bool = True) -> tuple[Any, Any]:
    """`state` updated (`_update`) until each MultiSteps in it has applied its inner
    update once (its gradient step counted one), at most `_MOST_ACCUMULATED` times; and
    whether each did."""

    def applied(now: Any) -> Any:
        return jnp.all(jnp.stack([n.gradient_step > 0 for n in _multi_steps(now)]))

    def more(carry: tuple[Any, Any]) -> Any:
        done, now = carry
        return (done < _MOST_ACCUMULATED) & ~applied(now)

    def step(carry: tuple[Any, Any]) -> tuple[Any, Any]:
        done, now = carry
        return done + 1, _update(tx, now, params, small)

    first = _update(tx, state, params, small)
    _, after = jax.lax.while_loop(more, step, (jnp.int32(1), first))
    return after, applied(after)


def rate_is_scheduled(tx: Any) -> bool | None:
    """Whether an injected learning rate of `tx` is recomputed by a schedule at each update
    (so writing it into the state does nothing); None when it cannot be probed.

    Example:
        >>> import optax
        >>> rate_is_scheduled(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
        False
    """
    scheduled = scheduled_hyperparams(tx)
    return None if scheduled is None else "learning_rate" in scheduled


def _applying(tx: Any) -> Any:
    """The optimizer whose every update applies: `optax.MultiSteps`'s inner one (also
    behind its `gradient_transformation()`), else `tx`."""
    steps = tx if isinstance(tx, optax.MultiSteps) else getattr(tx.update, "__self__", None)
    if isinstance(steps, optax.MultiSteps):
        return _applying(steps.inner_opt)
    return tx


def _mark(node: Any) -> Any:
    if not is_inject_state(node):
        return node
    marked = {
        name: jnp.asarray(_MARKER, value.dtype)
        if jnp.issubdtype(jnp.asarray(value).dtype, jnp.floating)
        else value
        for name, value in node.hyperparams.items()
    }
    return node._replace(hyperparams=marked)
