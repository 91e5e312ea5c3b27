"""Where an optax state holds its learning rate, and the parts that descend at one it
does not hold.

A rate is held by `optax.inject_hyperparams`'s state (its `hyperparams["learning_rate"]`;
not a state of another class holding such a dict, which nothing here lowers) or by a
schedule's (`ScaleByScheduleState`). The injected rate is found and written through the
functions here (the `learning_rate` metric, `reduce_lr_on_plateau` solo, on the device
and per member); `_optim` reads a schedule's rate through the schedule it finds.

`optax.multi_transform` (or `optax.partition`) and `optax.masked` give parts of the params
transformations of their own. Where one part's rate is injected (`inject_hyperparams`) or
scheduled and another part has a fixed rate (`optax.adam(1e-1)` beside it), no one number
is the run's learning rate, and lowering the injected one leaves the other part's as it
was. A part whose state is empty (`optax.set_to_zero()`, alone or in a chain, or a
zero-gradient transformation of the user's own with state `()`: a frozen part) has no
rate; a part inside an injected rate's state descends at that rate. A part that only
scales (`optax.scale(k)`) has an empty state too, so it is taken as frozen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

__all__ = [
    "find_learning_rates",
    "fixed_rate_groups",
    "holds_injected_rate",
    "inject_states",
    "is_inject_state",
    "lowered_rate",
    "map_injected_rates",
    "rate_value",
    "schedule_count",
    "several_rates_error",
]

_INJECT_STATES = tuple(
    cls
    for cls in (
        getattr(optax, "InjectHyperparamsState", None),
        getattr(optax, "InjectStatefulHyperparamsState", None),
    )
    if cls is not None
)


def is_inject_state(node: Any) -> bool:
    """Whether `node` is an `optax.inject_hyperparams` state (whatever it injects)."""
    return isinstance(node, _INJECT_STATES)


def holds_injected_rate(node: Any) -> bool:
    """Whether `node` is an `optax.inject_hyperparams` state injecting `learning_rate`."""
    return is_inject_state(node) and "learning_rate" in node.hyperparams


def inject_states(opt_state: Any) -> list[Any]:
    """The `optax.inject_hyperparams` states inside an optax state, in order (chains,
    groups and wrappers included)."""
    leaves = jax.tree.leaves(opt_state, is_leaf=is_inject_state)
    return [node for node in leaves if is_inject_state(node)]


def find_learning_rates(opt_state: Any) -> list[Any]:
    """The `learning_rate` hyperparameters found in an optax state (chains included).

    Example:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
        >>> [float(lr) for lr in find_learning_rates(tx.init(jnp.zeros(2)))]
        [0.5]
    """
    held = filter(holds_injected_rate, inject_states(opt_state))
    return [node.hyperparams["learning_rate"] for node in held]


def map_injected_rates(opt_state: Any, change: Callable[[Any], Any]) -> Any:
    """`opt_state` with each injected learning rate `old` replaced by `change(old)`.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
        >>> halved = map_injected_rates(tx.init(jnp.zeros(2)), lambda old: old / 2)
        >>> [float(lr) for lr in find_learning_rates(halved)]
        [0.25]
    """

    def replace(node: Any) -> Any:
        if not holds_injected_rate(node):
            return node
        new = change(node.hyperparams["learning_rate"])
        return node._replace(hyperparams={**node.hyperparams, "learning_rate": new})

    return jax.tree.map(replace, opt_state, is_leaf=is_inject_state)


def rate_value(rate: Any) -> float:
    """A learning rate as a Python float: its real part (optax holds the rate of complex
    params in their dtype, its imaginary part zero)."""
    return float(np.real(np.asarray(rate)))


def lowered_rate(rate: Any, scale: float, floor: float) -> float:
    """`max(rate * scale, floor)`, computed on the host in float64 so that it is a pure
    function of the old value (the same in a fused and an unfused run), to be cast once to
    the rate's dtype. `set_learning_rate` and `ReduceLROnPlateau.next_rate` (whose rates
    the device's dispatch takes) both lower a rate by it.

    Example:
        >>> lowered_rate(np.float32(0.1), 0.5, 0.01)
        0.05000000074505806
    """
    return max(rate_value(rate) * scale, floor)


def schedule_count(state: Any) -> int:
    """How many `scale_by_schedule` states `state` holds anywhere, groups included."""
    is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)  # noqa: E731
    return sum(map(is_schedule, jax.tree.leaves(state, is_leaf=is_schedule)))


_PARTS = (optax.MultiTransformState, optax.MaskedState)  # optax.partition's is the first


def fixed_rate_groups(opt_state: Any) -> int:
    """How many parts of `opt_state` descend at a rate it does not hold.

    Example:
        >>> import jax.numpy as jnp
        >>> injected = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
        >>> labels = lambda p: {"w": "a", "v": "b"}
        >>> params = {"w": jnp.zeros(1), "v": jnp.zeros(1)}
        >>> frozen = optax.multi_transform({"a": injected, "b": optax.set_to_zero()}, labels)
        >>> fixed_rate_groups(frozen.init(params))
        0
        >>> fixed = optax.multi_transform({"a": injected, "b": optax.adam(1e-1)}, labels)
        >>> fixed_rate_groups(fixed.init(params))
        1
    """
    found = 0
    for node in jax.tree.leaves(opt_state, is_leaf=_part_or_rate):
        if isinstance(node, optax.MaskedState):
            found += _fixed(node.inner_state)
        elif _is_part(node):
            found += sum(_fixed(group) for group in node.inner_states.values())
    return found  # parts inside an injected rate's state descend at that rate: not walked


def _is_part(node: Any) -> bool:
    return isinstance(node, _PARTS) or type(node).__name__ == "PartitionState"


def _part_or_rate(node: Any) -> bool:
    return _is_part(node) or _rate_held(node)


def _fixed(group: Any) -> int:
    """1 where `group` (a part's state) descends at a rate it does not hold."""
    while isinstance(group, optax.MaskedState):
        group = group.inner_state
    if group == () or isinstance(group, optax.EmptyState) or group == (optax.EmptyState(),):
        return 0  # set_to_zero(), alone or in a chain, or a zero_grads() of its own
    return 0 if any(map(_rate_held, jax.tree.leaves(group, is_leaf=_rate_held))) else 1


def _rate_held(node: Any) -> bool:
    """An injected learning rate (`inject_hyperparams`'s state) or a schedule's state."""
    return isinstance(node, optax.ScaleByScheduleState) or holds_injected_rate(node)


def several_rates_error() -> ValueError:
    """reduce_lr_on_plateau's refusal of an optimizer with a part of a fixed rate."""
    return ValueError(
        "reduce_lr_on_plateau: part of the params descend at a rate fixed inside this "
        "optimizer (a group of optax.multi_transform or optax.partition, or an optax.masked "
        "branch, without optax.inject_hyperparams), so lowering the injected rate would "
        "leave theirs as it is. Inject learning_rate in every part, freeze a part with "
        "optax.set_to_zero(), or lower the rates in a handler of your own"
    )
