"""Step builders: the pure functions the unfused and the fused loop both run.

A *program* knows how to build the initial step state and how to take one step:
`step(step_state, batch) -> (step_state, aux)`, where `aux` carries what metrics need
(`y_true`, `y_pred`, `loss`). `carry_step` wraps it with the metric accumulators and the
optional non-finite guard; that wrapped function is the one thing both loops execute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._arg_types import check_seed_bits
from ._batch_checks import require_pair
from ._epoch_order import prng_config
from ._functions import from_functions
from ._metric_reads import metric_value
from ._metrics import Mean, MetricSpec, batch_size, loss_mean, resolve_loss
from ._model_fit_advice import no_params, not_floating
from ._optim import (
    OPTIMIZERS,
    exposes_learning_rate,
    learning_rate_of,
    optimizer_init,
    optimizer_update,
    resolve_optimizer,
)
from ._outputs_at import model_outputs_at, outputs_at
from ._warn import warn
from .models import as_model

__all__ = [
    "Program",
    "trainer_program",
    "evaluator_program",
    "make_carry_step",
    "default_metrics",
    "OPTIMIZERS",
    "resolve_optimizer",
    "warn_sown_losses",
    "check_loop_program",
]


def split_batch(batch: Any) -> tuple[Any, Any]:
    """`(x, y)` from a batch; anything else is a clear error."""
    require_pair(batch)
    return batch[0], batch[1]


@dataclass(frozen=True)
class Program:
    """A step function and how to start it.

    Attributes:
        init: `(first_batch, init_state) -> step_state` (runs on the host, once per run).
        step: `(step_state, batch) -> (step_state, aux)`; pure and jit-able.
        donate_state: Whether the step state may be donated (False for evaluators, whose
            step state is the caller's params).
        kind: "trainer", "evaluator" or "custom".
    """

    init: Callable[[Any, Any], Any]
    step: Callable[[Any, Any], tuple[Any, dict[str, Any]]]
    donate_state: bool
    kind: str
    loss_name: str | None = None
    optimizer: Any = None
    model: Any = None
    loss: Any = None
    exposes_lr: bool = False  # the step's aux holds "learning_rate"
    data_name: str = "data"  # what gives its batches, for warnings ("validate()'s data")


def check_loop_program(program: Any) -> None:
    """A `Loop` is built by `fl.trainer`, `fl.evaluator` or `fl.loop`, which make its
    Program; a step function or model handed to `fl.Loop(...)` itself is refused here,
    rather than failing later on a missing attribute."""
    if not isinstance(program, Program):
        raise TypeError(
            f"Loop: got {type(program).__name__} {program!r:.60}; a Loop is not built "
            "directly. Use fl.loop(step_fn, init_fn) for a step function of your own, "
            "fl.trainer(model, loss, optimizer) to train a model, or fl.evaluator(model) "
            "to evaluate one"
        )


def _trainable(variables: Any) -> tuple[Any, Any]:
    """Splits variables into (trainable params, the rest)."""
    if isinstance(variables, dict) and "params" in variables:
        rest = {k: v for k, v in variables.items() if k != "params"}
        return variables["params"], rest
    return variables, None


def warn_sown_losses(program: Program, step_state: Any) -> None:
    """A trainer's model with a "losses" collection (what `self.sow("losses", ...)` keeps):
    it is carried as state, but the objective is the loss of (y, y_pred) alone, which is
    said rather than trained without them in silence (on the host, at a run's start)."""
    variables = step_state.get("params") if isinstance(step_state, dict) else None
    if program.kind == "trainer" and isinstance(variables, dict) and "losses" in variables:
        warn(
            "model: its variables hold a 'losses' collection (values the model sows with "
            "self.sow('losses', ...)); fuseloop's trainer carries it as state, but its "
            "objective is the loss of (y, y_pred) alone, so those values are not trained "
            "on. To add them to the objective, write the step with fl.loop"
        )


def _unfrozen(variables: Any) -> Any:
    """`variables` with every flax FrozenDict among its dicts made a plain dict (the same
    arrays): a FrozenDict (older flax, a TrainState's variables, or one collection of them
    put in a dict) is not a dict, so its batch_stats would be read as params and trained,
    and the step, whose model returns plain dicts, would change the state's structure. A
    dict subclass (an OrderedDict) becomes a plain dict for the same reason."""
    from flax.core import FrozenDict, unfreeze

    return unfreeze(variables) if isinstance(variables, (FrozenDict, dict)) else variables


def _checked_params(adapter: Any, variables: Any) -> Any:
    """The params a trainer trains in `variables`, refused where it cannot train them (no
    variables at all is left to the run's model checks, which name init)."""
    _check_params(adapter, variables)
    params, _ = _trainable(variables)
    if not jax.tree.leaves(params) and jax.tree.leaves(variables):
        raise no_params(adapter)
    return params


def _check_params(adapter: Any, variables: Any) -> None:
    """The params a trainer differentiates, refused with the fix where some would silently
    never train (a plain pair's "params" entry beside others: only it trains, flax's
    convention, and `apply_fn` returns no updates for the rest) or cannot (a leaf that is
    not floating point, for any model: JAX's error names no weight)."""
    params, rest = _trainable(variables)
    if rest is None and not isinstance(adapter, from_functions):
        return  # not a flax model's variables: the run's model checks say what they are
    if rest and isinstance(adapter, from_functions):
        raise ValueError(
            f"model: init_fn returned a dict with a 'params' entry and others "
            f"({sorted(map(str, rest))}); a trainer trains only variables['params'] (flax's "
            f"convention), and a plain (init_fn, apply_fn) pair returns no updates for the "
            f"others, so they would never change. Put every trainable array under 'params', "
            f"or return the params without a 'params' key; for a flax module (batch_stats), "
            f"pass the module itself"
        )
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            where = jax.tree_util.keystr(path)
            raise not_floating(adapter, where, jnp.result_type(leaf))


def _merge(params: Any, rest: Any) -> Any:
    if rest is None:
        return params
    return {"params": params, **rest}


@functools.lru_cache(maxsize=64)
def _seed_keys(seed: int, prng: tuple[str, bool], x64: bool) -> tuple[np.ndarray, np.ndarray]:
    """`jax.random.split(jax.random.PRNGKey(seed))` as host arrays, computed once per seed
    and PRNG configuration (`prng`: `prng_config()`, on which the split depends; `x64`,
    on which the key of a seed past 32 bits does):
    constants of the init program (derived inside it, XLA:CPU ran threefry's loop at
    every run). The transfer of the seed is the library's own, allowed under any guard.
    """
    with jax.transfer_guard("allow"), jax.ensure_compile_time_eval():
        keys = np.asarray(jax.random.split(jax.random.PRNGKey(seed)))
    return keys[0], keys[1]


def _descend(tx: Any, objective: Callable[[Any], Any], params: Any, opt_state: Any) -> Any:
    """One descent step: `(loss, aux, new params, new optimizer state)` from `objective(p)
    -> (loss, aux)`; an optimizer that reads the loss or re-evaluates it (a line search)
    gets both (`optimizer_update`)."""
    (value, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
    # jax.grad of a real loss gives a complex param the conjugate of its descent direction
    # (JAX's convention); optax descends along what it is given.
    grads = jax.tree.map(lambda g: jnp.conj(g) if jnp.iscomplexobj(g) else g, grads)
    updates, opt_state = optimizer_update(
        tx, grads, opt_state, params, value, lambda p: objective(p)[0]
    )
    return value, aux, optax.apply_updates(params, updates), opt_state


def trainer_program(model: Any, loss: Any, optimizer: Any, seed: int) -> Program:
    """The supervised training step: forward, loss, gradient and optimizer update."""
    adapter = as_model(model)
    loss_name, _ = resolve_loss(loss)
    loss_fn = loss_mean(loss)
    # CLASSIFYING metrics read binary labels so (a callable's __name__ says nothing)
    binary_labels = isinstance(loss, str) and loss_name == "binary_cross_entropy"
    tx = resolve_optimizer(optimizer)
    exposes_lr = exposes_learning_rate(tx)

    def init(first_batch: Any, variables: Any) -> dict[str, Any]:
        x, _ = split_batch(first_batch)
        if isinstance(seed, (int, np.integer)):
            check_seed_bits(int(seed))  # x64 may have changed since the trainer was built
            x64 = bool(jax.config.read("jax_enable_x64"))
            init_key, dropout_key = _seed_keys(int(seed), prng_config(), x64)
        else:  # a population's member seeds, traced
            init_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        if variables is None:
            variables = adapter.init(init_key, x)
        variables = _unfrozen(variables)
        params = _checked_params(adapter, variables)
        return {
            "params": variables,
            "opt_state": optimizer_init(tx, params),
            "rng": dropout_key,
            "step": jnp.zeros((), jnp.int32),
        }

    def step(state: dict[str, Any], batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        x, y = split_batch(batch)
        # Randomness comes from the global step counter, so a fused and an unfused run
        # (and a resumed one) draw the same dropout masks.
        key = jax.random.fold_in(state["rng"], state["step"])
        params, rest = _trainable(state["params"])

        def objective(p: Any) -> tuple[Any, tuple[Any, Any, Mean]]:
            y_pred, new_rest = adapter.forward(_merge(p, rest), x, train=True, rng=key)
            with model_outputs_at(outputs_at(adapter, state["params"], x)):
                value, mean = loss_fn(y, y_pred, x)
            return value, (y_pred, new_rest, mean)

        descended = _descend(tx, objective, params, state["opt_state"])
        loss_value, (y_pred, new_rest, mean), params, opt_state = descended
        aux = {**_read_by_metrics(x, y, y_pred, binary_labels), "loss": loss_value}
        aux["means"] = {"loss": mean}
        if exposes_lr:
            aux["learning_rate"] = learning_rate_of(tx, opt_state)
        new_state = {
            "params": _merge(params, rest if new_rest is None else new_rest),
            "opt_state": opt_state,
            "rng": state["rng"],
            "step": state["step"] + 1,
        }
        return new_state, aux

    return Program(init, step, True, "trainer", loss_name, tx, adapter, loss, exposes_lr)


def evaluator_program(model: Any, loss: Any = None) -> Program:
    """The evaluation step: a forward pass in inference mode (and the loss, if given)."""
    adapter = as_model(model)
    loss_name = resolve_loss(loss)[0] if loss is not None else None
    loss_fn = loss_mean(loss) if loss is not None else None
    binary_labels = isinstance(loss, str) and loss_name == "binary_cross_entropy"

    def init(first_batch: Any, variables: Any) -> dict[str, Any]:
        if variables is None:
            built = getattr(adapter, "initialised_when_built", None)  # nnx, equinox
            raise ValueError(
                "init_state: an evaluator needs trained variables (or a State holding "
                "them): evaluator(model).run(data, params)"
                + ("; a module built with its weights is one: .run(data, model)" if built else "")
            )
        return {"params": variables}

    def step(state: dict[str, Any], batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        x, y = split_batch(batch)
        y_pred, _ = adapter.forward(state["params"], x, train=False, rng=None)
        aux = _read_by_metrics(x, y, y_pred, binary_labels)
        if loss_fn is not None:
            with model_outputs_at(outputs_at(adapter, state["params"], x)):
                aux["loss"], mean = loss_fn(y, y_pred, x)
            aux["means"] = {"loss": mean}
        return state, aux

    return Program(init, step, False, "evaluator", loss_name, None, adapter, loss)


def _read_by_metrics(x: Any, y: Any, y_pred: Any, binary_labels: bool) -> dict[str, Any]:
    """What the metrics of (y_true, y_pred) read of a step (`_metric_reads`), with the
    batch's count of examples: y's rows, or x's where y has no example axis."""
    return {
        "y_pred": y_pred,
        "y_true": y,
        "examples": batch_size(y, x),
        "binary_labels": binary_labels,
    }


def default_metrics(program: Program) -> tuple[MetricSpec, ...]:
    """The metrics a trainer or evaluator tracks by itself: "loss" (a mean over examples)
    when it has a loss, and "learning_rate" (the rate of the epoch's last step) when the
    trainer's optimizer exposes it."""
    specs = []
    if program.loss_name is not None:
        specs.append(MetricSpec("loss", None, source="loss"))
    if program.exposes_lr:
        specs.append(MetricSpec("learning_rate", None, accumulate="last", source="learning_rate"))
    return tuple(specs)


def init_tail(metrics: tuple[MetricSpec, ...], guard_nonfinite: bool) -> dict[str, Any]:
    """The part of the carry beside the step state: metric sums/counts and the guard flag."""
    tail: dict[str, Any] = {"acc": {m.name: m.init() for m in metrics}}
    if guard_nonfinite:
        tail["nonfinite"] = jnp.zeros((), jnp.bool_)
    return tail


def _outputs_of(program: Program, state: Any, batch: Any) -> Any:
    """The model's outputs at another batch size, for a trainer's or an evaluator's
    metrics (`_outputs_at.py`); None for a custom step, whose outputs fuseloop cannot make."""
    if program.model is None or not isinstance(state, dict) or "params" not in state:
        return None
    return outputs_at(program.model, state["params"], split_batch(batch)[0])


def make_carry_step(
    program: Program,
    metrics: tuple[MetricSpec, ...],
    guard_nonfinite: bool,
    *,
    keep_old: bool = True,
) -> Callable[[Any, dict[str, Any], Any], tuple[Any, dict[str, Any]]]:
    """`(step_state, tail, batch) -> (step_state, tail)`: one step plus metric accumulation.

    With the guard on, a step whose loss is not finite sets `tail["nonfinite"]` (which
    stays True). With `keep_old` that step is not committed: the step state and the
    accumulators stay as they were. Without it the step is committed and whoever runs the
    step undoes it (`_fusion.make_chunk_fn`): a select at every step keeps the old state
    alive beside the new one, which costs a copy of the step state per step and lets XLA
    fuse, and so round, the step otherwise than an unguarded one (docs/design.md §2).
    """

    def carry_step(state: Any, tail: dict[str, Any], batch: Any) -> tuple[Any, dict[str, Any]]:
        new_state, aux = program.step(state, batch)
        with model_outputs_at(_outputs_of(program, state, batch)):
            acc = {m.name: m.update(tail["acc"][m.name], metric_value(m, aux)) for m in metrics}
        if not guard_nonfinite:
            return new_state, {"acc": acc}
        if "loss" not in aux:
            raise ValueError(
                "terminate_on_nan needs a loss: use it with a trainer, or return a dict step "
                "state with a scalar 'loss' from a custom loop"
            )
        bad = tail["nonfinite"] | ~jnp.all(jnp.isfinite(aux["loss"]))
        if not keep_old:
            return new_state, {"acc": acc, "nonfinite": bad}
        keep = lambda old, new: jax.lax.select(bad, old, new)  # noqa: E731
        new_state = jax.tree.map(keep, state, new_state)
        acc = jax.tree.map(keep, tail["acc"], acc)
        return new_state, {"acc": acc, "nonfinite": bad}

    return carry_step
