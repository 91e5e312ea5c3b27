"""Optimizers: the named ones, and the learning rate an optimizer exposes.

Named optimizers ("sgd", "adam", "adamw") are built with `optax.inject_hyperparams`, so the
learning rate lives in the optimizer state (reduce_lr_on_plateau changes it there), with
hyperparameters and an optimizer state at least float32 wide whatever the params' dtype: in
bfloat16, adam's b2=0.999 rounds to 1.0 and the loss turns NaN from the second step.
float64 params (under `jax_enable_x64`) keep float64 throughout, as the optax
transformation the name stands for does.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._rate_groups import (
    find_learning_rates,
    fixed_rate_groups,
    lowered_rate,
    map_injected_rates,
    schedule_count,
)
from ._sums import accumulator_dtype

__all__ = [
    "OPTIMIZERS",
    "resolve_optimizer",
    "abstract_state",
    "learning_rate_of",
    "exposes_learning_rate",
    "set_learning_rate",
    "has_schedule",
    "optimizer_init",
    "optimizer_update",
]

OPTIMIZERS: dict[str, tuple[Callable[..., optax.GradientTransformation], float]] = {
    "sgd": (optax.sgd, 1e-2),
    "adam": (optax.adam, 1e-3),
    "adamw": (optax.adamw, 1e-3),
}


def _to_float32(tree: Any) -> Any:
    """`tree` with its floats narrower than float32 (bfloat16, float16) widened to float32;
    float32 and float64 leaves stay as they are."""

    def cast(leaf: Any) -> Any:
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
            return jnp.asarray(leaf, jnp.float32)
        return leaf

    return jax.tree.map(cast, tree)


def _any_float64(tree: Any) -> bool:
    """Whether a leaf of `tree` is double width: float64, or complex128 (of float64 parts)."""
    wide = (jnp.float64, jnp.complex128)
    return any(jnp.result_type(leaf) in wide for leaf in jax.tree.leaves(tree))


def in_float32(
    inner: optax.GradientTransformation, for_float64: optax.GradientTransformation | None = None
) -> optax.GradientTransformation:
    """`inner` run on copies of the gradients and params at least float32 wide; its state is
    float32 for bfloat16 or float16 params (float64 stays float64: never narrowed) and its
    updates are cast back to each gradient's dtype. With float32 params every cast is the
    identity, so nothing changes there. The state is `inner`'s own (same structure).

    `for_float64`: the transformation to run instead where a param is float64 (under
    `jax_enable_x64`), e.g. with float64 hyperparameters; None: `inner`.
    """
    wide = inner if for_float64 is None else for_float64

    def init(params: Any) -> Any:
        return (wide if _any_float64(params) else inner).init(_to_float32(params))

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        wide_params = None if params is None else _to_float32(params)
        chosen = wide if _any_float64(grads) else inner
        updates, new = chosen.update(_to_float32(grads), state, wide_params)
        updates = jax.tree.map(lambda u, g: u.astype(jnp.result_type(g)), updates, grads)
        # float64 hyperparameters widen the state of float32 leaves beside float64 ones.
        return updates, jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), new, state)

    return optax.GradientTransformation(init, update)


def resolve_optimizer(optimizer: Any) -> optax.GradientTransformation:
    """Returns an optax transformation for a name or a transformation."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={optimizer!r} is not a known optimizer; accepted values: "
                f"{', '.join(OPTIMIZERS)} or an optax.GradientTransformation"
            )
        factory, learning_rate = OPTIMIZERS[optimizer]
        made = {
            dtype: optax.inject_hyperparams(factory, hyperparam_dtype=dtype)(
                learning_rate=learning_rate
            )
            for dtype in (jnp.float32, jnp.float64)
        }
        return in_float32(made[jnp.float32], made[jnp.float64])
    if isinstance(optimizer, optax.GradientTransformation) or (
        hasattr(optimizer, "init") and hasattr(optimizer, "update")
    ):
        _refuse_lookahead(optimizer)
        return optimizer
    maker = (
        f"; {getattr(optimizer, '__name__', 'it')} looks like a function that makes one: "
        f"call it, e.g. optimizer=optax.adam(1e-3)"
        if str(getattr(optimizer, "__module__", None)).startswith(("optax._src.alias", "optax.c"))
        else ""
    )
    raise ValueError(
        f"optimizer={optimizer!r} must be a name ({', '.join(OPTIMIZERS)}) or an "
        f"optax.GradientTransformation{maker}"
    )


def _refuse_lookahead(tx: Any) -> None:
    """optax.lookahead steps `optax.LookaheadParams` (fast and slow weights), not the
    model's params a trainer hands it: on a plain dict its init only logs a warning and
    its first update fails inside optax."""
    if getattr(tx.init, "__qualname__", "").startswith("lookahead."):
        raise ValueError(_LOOKAHEAD)


_LOOKAHEAD = (
    "optimizer: optax.lookahead trains optax.LookaheadParams (fast and slow weights), not "
    "the model's params that fl.trainer steps. Write the step with fl.loop instead, keeping "
    "optax.LookaheadParams.init_synced(params) in the step state, applying the model to its "
    ".fast weights in training and to its .slow weights to evaluate"
)


def _holds_lookahead(opt_state: Any) -> bool:
    """Whether an optimizer's state holds a lookahead's, one wrapped in a chain or in
    optax.MultiSteps included (`_refuse_lookahead` sees only a bare one)."""
    lookahead = getattr(optax, "LookaheadState", None)
    if lookahead is None:
        return False
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda node: isinstance(node, lookahead))
    return any(isinstance(node, lookahead) for node in nodes)


def optimizer_init(tx: Any, params: Any) -> Any:
    """`tx.init(params)`; a ValueError naming the fix where the optimizer's own trees (the
    labels of `optax.multi_transform`, the mask of `optax.masked`) are not shaped like the
    params it is given."""
    try:
        opt_state = tx.init(params)
    except ValueError as error:
        if "pytree structure" not in str(error) and "node type mismatch" not in str(error):
            raise
        first = str(error).strip().splitlines()[0]
        raise ValueError(
            f"optimizer: its init fails on the model's params ({first}): labels or masks it "
            f"holds (optax.multi_transform, optax.masked) must be shaped like "
            f"variables['params'], plain dicts of arrays. For an nnx module, build them from "
            f"nnx.to_pure_dict(nnx.state(model, nnx.Param)) rather than from the State itself"
        ) from error
    if _holds_lookahead(opt_state):
        raise ValueError(_LOOKAHEAD)
    return opt_state


def optimizer_update(
    tx: Any, grads: Any, opt_state: Any, params: Any, value: Any, value_fn: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """`tx.update`, given what optax's extra-args transformations read, as a hand-written
    loop passes them: the batch's loss (`value`; `optax.contrib.reduce_on_plateau`,
    `optax.polyak_sgd`), its gradient (`grad`) and the loss as a function of the params
    (`value_fn`; the line searches of `optax.lbfgs`). Transformations that take no extra
    arguments ignore them (optax's convention), and an unused `value_fn` is never traced.
    """
    if not isinstance(tx, optax.GradientTransformationExtraArgs) and not _takes_extra(tx):
        return tx.update(grads, opt_state, params)
    try:
        return tx.update(grads, opt_state, params, value=value, grad=grads, value_fn=value_fn)
    except TypeError as error:
        raise _extra_args_error(error) from error


def _takes_extra(tx: Any) -> bool:
    """Whether `tx.update` takes keyword arguments beyond optax's three (`optax.MultiSteps`
    passes them on to the optimizer it wraps)."""
    try:
        parameters = inspect.signature(tx.update).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def _extra_args_error(error: TypeError) -> BaseException:
    """A ValueError naming the fix where an extra-args update refuses what a trainer passes."""
    text = str(error)
    if "required keyword-only argument" in text:
        return ValueError(
            f"optimizer: its update asks for arguments fuseloop does not pass ({text}); a "
            f"trainer passes value (the batch's loss), grad and value_fn (the loss of the "
            f"params on the batch). Write the step yourself with fl.loop to pass others"
        )
    if "unexpected keyword argument" in text:
        return ValueError(
            f"optimizer: it is an optax.GradientTransformationExtraArgs whose update does not "
            f"take the extra arguments a trainer passes (value, grad, value_fn): {text}. "
            f"Give its update **extra_args, as optax's own transformations have"
        )
    return error


def abstract_state(tx: Any) -> Any | None:
    """`tx`'s state for a tiny stand-in of params, found abstractly (nothing runs); None
    for an optimizer whose structure depends on the params' own (e.g. a pytree of labels).
    Kept while `tx.init` lives, so a population's every run does not trace the optimizer's
    init again. Keyed weakly: an optimizer closing over device arrays (a preconditioner, a
    mask) must not be kept alive by fuseloop once the user's own references are gone.
    """
    init = getattr(tx, "init", None)  # a method is made anew at each read: never kept
    try:
        return _ABSTRACT_STATES[init]
    except (KeyError, TypeError):  # not asked yet, or an init no weak reference can hold
        pass
    found = _abstract_state(tx)
    with contextlib.suppress(TypeError):  # an init no weak reference can hold: not kept
        _ABSTRACT_STATES[init] = found
    return found


_ABSTRACT_STATES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _abstract_state(tx: Any) -> Any | None:
    try:
        return jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((1,), jnp.float32)})
    except Exception:  # noqa: BLE001 - whatever the optimizer raises for a foreign structure
        return None


def set_learning_rate(opt_state: Any, scale: float, floor: float) -> Any:
    """`opt_state` with every injected learning rate set to max(lr * scale, floor)."""

    return map_injected_rates(
        opt_state, lambda old: jnp.asarray(lowered_rate(old, scale, floor), old.dtype)
    )


class _Schedule(NamedTuple):
    schedule: Callable[[Any], Any]
    path: tuple[int, ...]  # where its ScaleByScheduleState sits in the (chained) state
    rate: bool  # a learning rate given as a schedule, not another scale on the updates


def _closure(fn: Any) -> dict[str, Any]:
    cells = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    found = {}
    for name, cell in zip(names, cells, strict=True):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return found


def _schedules(update: Any, state: Any, path: tuple[int, ...] = ()) -> list[_Schedule]:
    """Every `optax.scale_by_schedule` inside `update`, following `optax.chain`: a learning
    rate given as a schedule (`optax.adam(optax.cosine_decay_schedule(...))`, which optax
    builds through `scale_by_learning_rate`) or another scale on the updates (a user's own
    `scale_by_schedule(warmup)`, which multiplies whatever rate the chain has)."""
    cells = _closure(update)
    wrapped = cells.get("tx")  # optax's with_extra_args_support wraps a transformation
    if wrapped is not None and hasattr(wrapped, "update") and len(cells) == 1:
        return _schedules(wrapped.update, state, path)
    step_size = cells.get("step_size_fn")
    if isinstance(state, optax.ScaleByScheduleState) and callable(step_size):
        # scale_by_learning_rate's schedule is `lambda count: m * learning_rate(count)`.
        inner = _closure(step_size)
        return [_Schedule(step_size, path, callable(inner.get("learning_rate")) and "m" in inner)]
    chained = cells.get("update_fns")
    found: list[_Schedule] = []
    if (
        isinstance(chained, (tuple, list))
        and isinstance(state, tuple)
        and len(chained) == len(state)
    ):
        for i, (inner_update, inner_state) in enumerate(zip(chained, state, strict=True)):
            found += _schedules(inner_update, inner_state, path + (i,))
    return found


def learning_rate_of(tx: Any, opt_state: Any) -> Any | None:
    """The learning rate the last update of `tx` used, read from its new state; None when
    the optimizer does not expose it (jit-able)."""
    rates = find_learning_rates(opt_state)
    dtype = accumulator_dtype()  # the metric's: float64 under x64, not rounded to float32
    if rates:
        # complex params: optax holds the rate in their dtype, its imaginary part zero
        return jnp.asarray(jnp.real(rates[0]), dtype) * _plateau_scale(opt_state)
    found = [s for s in _schedules(getattr(tx, "update", None), opt_state) if s.rate]
    if not found:
        return None
    node = opt_state
    for i in found[0].path:
        node = node[i]
    # scale_by_schedule counts updates; the last one used the count before it advanced.
    # optax folds the descent sign into the scale, so the rate is its magnitude.
    rate = jnp.abs(jnp.asarray(found[0].schedule(node.count - 1), dtype))
    return rate * _plateau_scale(opt_state)


def _plateau_scale(opt_state: Any) -> Any:
    """The product of the scales of `optax.contrib.reduce_on_plateau` in `opt_state`: it
    multiplies every update, so the rate the step applies is the rate times it (as Keras
    reports the rate its ReduceLROnPlateau lowered)."""
    scale = jnp.ones((), accumulator_dtype())
    for node in jax.tree.leaves(opt_state, is_leaf=_is_plateau_state):
        if _is_plateau_state(node):
            scale = scale * jnp.asarray(node.scale, scale.dtype)
    return scale


def _is_plateau_state(node: Any) -> bool:
    return {"scale", "plateau_count"} <= set(getattr(node, "_fields", ()))


def exposes_learning_rate(tx: Any) -> bool:
    """Whether `learning_rate_of` finds a rate for `tx` (checked on a tiny abstract probe;
    an optimizer whose state depends on the params' structure is taken as not exposing)."""
    if (state := abstract_state(tx)) is None:
        return False  # a structure-dependent optimizer: not exposed
    if any(not s.rate for s in _schedules(getattr(tx, "update", None), state)):
        return False  # a scale of its own multiplies the rate: no one number is it
    if len(find_learning_rates(state)) + schedule_count(state) + fixed_rate_groups(state) > 1:
        return False  # several rates (optax.multi_transform): no one number is it
    try:
        return jax.eval_shape(lambda s: learning_rate_of(tx, s), state) is not None
    except Exception:  # noqa: BLE001 - a state learning_rate_of cannot read: not exposed
        return False


def has_schedule(tx: Any) -> bool:
    """Whether `tx` takes its rate from an optax schedule (`scale_by_schedule`)."""
    state = abstract_state(tx)
    return state is not None and bool(_schedules(getattr(tx, "update", None), state))
