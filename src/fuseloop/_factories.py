"""The factories that build a `Loop`: `trainer`, `evaluator` and `loop`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

from . import _foreign_keywords as keywords
from ._custom_step import custom_program
from ._loop import Loop
from ._loop_args import check_step_functions, check_trainer_options, warn_unused_seed
from ._step import default_metrics, evaluator_program, trainer_program

__all__ = ["trainer", "evaluator", "loop"]


@keywords.advise_foreign_keywords(keywords.FACTORY_ADVICE)
def trainer(
    model: Any,
    loss: Any,
    optimizer: Any,
    *,
    log: int = 0,
    seed: int = 0,
    log_stream: TextIO | None = None,
) -> Loop:
    """A supervised training loop that tracks "loss".

    Args:
        model: A flax.linen module (or any object with `.init(rng, x)` / `.apply(vars, x)`,
            an nnx/equinox module, or an `(init_fn, apply_fn)` pair).
        loss: A loss name ("mean_squared_error", "mean_absolute_error",
            "binary_cross_entropy", "categorical_cross_entropy",
            "sparse_categorical_cross_entropy", or Keras's spellings "mse", "mae",
            "sparse_categorical_crossentropy", ...) or `callable(y_true, y_pred) -> scalar`;
            cross-entropies take logits.
        optimizer: An optax transformation, or "sgd", "adam", "adamw".
        log: Print a line every `log` iterations, and one at each epoch's end (0: silent).
        seed: Seeds parameter initialization and dropout (a flax.linen model's; an
            equinox model's dropout; an nnx model draws both from its own nnx.Rngs) as
            `init, drop = jax.random.split(jax.random.PRNGKey(seed))`: `init` initializes,
            and global step s draws its dropout from `jax.random.fold_in(drop, s)`.
        log_stream: Where log lines go (stdout by default).

    Example:
        >>> import fuseloop as fl, optax
        >>> loop = fl.trainer(fl.models.mlp([32, 10]), "sparse_categorical_cross_entropy",
        ...                   optax.adam(1e-3), log=50)
    """
    log, seed = check_trainer_options(log, seed, log_stream)
    program = trainer_program(model, loss, optimizer, seed)
    warn_unused_seed(program.model, seed)
    if hasattr(program.model, "warn_for_training"):  # an nnx module: LoRA, eval modes
        program.model.warn_for_training(program.optimizer)
    built = Loop(program, metrics=default_metrics(program))
    if log:
        from .handlers.log import attach_trainer_log

        built = attach_trainer_log(built, log, log_stream)._own_since(built)
    return built


@keywords.advise_foreign_keywords(keywords.EVALUATOR_ADVICE)
def evaluator(model: Any, loss: Any = None) -> Loop:
    """An evaluation loop: `evaluator(model).run(data, params_or_state)`.

    Args:
        model: The model, in any form `trainer` takes.
        loss: None, or a loss name or `callable(y_true, y_pred)`: then the loop tracks
            "loss", a mean over the examples.

    Example:
        >>> variables = model.init(jax.random.PRNGKey(0), batches[0][0])
        >>> scores = evaluator(model, "sparse_categorical_cross_entropy").metric("accuracy")
        >>> sorted(scores.run(val_batches, variables).metrics)
        ['accuracy', 'loss']
    """
    program = evaluator_program(model, loss)
    return Loop(program, metrics=default_metrics(program))


def loop(
    step_fn: Callable[[Any, Any], Any], init_fn: Callable[[Any, Any], Any] | None = None
) -> Loop:
    """A custom loop around `step_fn(batch, step_state) -> step_state` (pure, jit-able).

    Args:
        step_fn: One step.
        init_fn: `init_fn(first_batch, init_state) -> step_state` (default: `init_state`).

    Example:
        >>> count = fl.loop(lambda batch, s: {"n": s["n"] + 1})
        >>> int(count.run([(0, 0)] * 3, {"n": 0}).step_state["n"])
        3
    """
    check_step_functions(step_fn, init_fn)
    return Loop(custom_program(step_fn, init_fn))
