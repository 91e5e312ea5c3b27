"""Keyword arguments from Keras's `fit`/`compile` and Lightning's `Trainer`, answered with
fuseloop's way of saying the same thing instead of Python's bare "unexpected keyword".

The check runs before the call and costs a set comparison; a keyword the function takes
never reaches it, so nothing a function accepts changes meaning here.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

__all__ = [
    "ARRAYS_ADVICE",
    "HANDLER_ADVICE",
    "RUN_ADVICE",
    "FACTORY_ADVICE",
    "EVALUATOR_ADVICE",
    "POSITIONAL",
    "TOO_FEW",
    "advise_foreign_keywords",
]

POSITIONAL = "*"  # the advice for more positional arguments than the function takes
TOO_FEW = "-"  # the advice for fewer arguments than the function requires

P = ParamSpec("P")
R = TypeVar("R")

_BATCH = "fuseloop batches the data before the run: pass fl.data.arrays(x, y, batch_size=32)"
_HANDLERS = (
    "fuseloop attaches callbacks to the loop before the run: loop.early_stop(...), "
    "loop.checkpoint(...), loop.reduce_lr_on_plateau(...), loop.csv_log(...), or "
    'loop.handle_event("epoch_completed", fn) for your own'
)
_DATA_FIRST = "the data is the first argument: run(fl.data.arrays(x, y, batch_size=32))"
_ITERATIONS = "iterations=N bounds each epoch's iterations"
_EPOCHS = "epochs go to the run: loop.run(data, epochs=N)"
_SHUFFLE = "shuffling belongs to the data: fl.data.arrays(x, y, batch_size, shuffle=True)"
_RATE = "the optimizer holds the rate: fl.trainer(model, loss, optax.adam(1e-3))"
_WEIGHTS = (
    "per-example weights go into y, for a loss that reads them (docs/data.md, "
    "\"A trainer's or evaluator's batch\")"
)

# Keras `fit` and Lightning `Trainer`/`fit` keywords, by what fuseloop calls them.
RUN_ADVICE: Mapping[str, str] = {
    POSITIONAL: (
        "run() takes the data and an initial state by position, the rest by keyword: "
        "Keras's fit(x, y, batch_size, epochs) is "
        "run(fl.data.arrays(x, y, batch_size=32), epochs=10)"
    ),
    "batch_size": _BATCH + " as the data",
    "shuffle": _SHUFFLE,
    "x": _DATA_FIRST,
    "y": _DATA_FIRST,
    "validation_data": "attach validation to the loop: loop.validate(model, val_data).run(data)",
    "validation_split": (
        "hold the last part out yourself and attach it: loop.validate(model, "
        "fl.data.arrays(x_val, y_val, batch_size=32, shuffle=False, drop_remainder=False))"
    ),
    "callbacks": _HANDLERS,
    "verbose": (
        "run(progress=True) shows a bar per epoch (one line per epoch off a terminal, "
        "as Keras's verbose=2); fl.trainer(..., log=N) prints a line every N iterations"
    ),
    "steps_per_epoch": _ITERATIONS,
    "limit_train_batches": _ITERATIONS,
    "max_epochs": "epochs=N is the total number of epochs",
    "initial_epoch": (
        "resume from the State a run returned (or a checkpoint): run(data, state, epochs=N)"
    ),
    "ckpt_path": "resume from fl.load_state(path): run(data, state, epochs=N)",
    "steps_per_execution": "fuse=K runs K steps per dispatch",
    "train_dataloaders": "the data is the first argument: run(loader)",
    "val_dataloaders": "attach validation to the loop: loop.validate(model, loader).run(data)",
    "datamodule": "pass the training data first, run(data), and attach validation with "
    "loop.validate(model, val_data)",
    "metrics": 'metrics are added to the loop before the run: loop.metric("accuracy")',
    "learning_rate": _RATE,
    "lr": _RATE,
    "class_weight": _WEIGHTS,
    "sample_weight": _WEIGHTS,
    "validation_freq": (
        'attach validation with a filter: loop.validate(model, val_data, filter={"every": N})'
    ),
    "validation_steps": "iterations are the validation data's: give the batches you want",
    "workers": "fuseloop stacks and transfers the next chunk while the device runs this one",
    "use_multiprocessing": "fuseloop stacks and transfers the next chunk while the device runs",
}

# Keras `compile` keywords given to fl.trainer / fl.evaluator.
FACTORY_ADVICE: Mapping[str, str] = {
    POSITIONAL: (
        'metrics are added to the loop this returns (.metric("accuracy")); any other option '
        "is given by keyword"
    ),
    "metrics": 'add each metric to the loop this returns: .metric("accuracy")',
    "learning_rate": "give the optimizer its rate: optax.adam(learning_rate=1e-3)",
    "lr": "give the optimizer its rate: optax.adam(learning_rate=1e-3)",
    "epochs": _EPOCHS,
    "batch_size": _BATCH + " to run()",
    "callbacks": _HANDLERS,
    "jit_compile": "fuseloop compiles by default; run(..., jit=False) runs op by op to debug",
    "steps_per_execution": "fuse=K in run() runs K steps per dispatch",
    "max_epochs": _EPOCHS,
    "steps_per_epoch": "iterations go to the run: loop.run(data, iterations=N)",
    "validation_data": "attach validation to the loop: loop.validate(model, val_data)",
    "verbose": "run(progress=True) shows a bar per epoch",
    "shuffle": _SHUFFLE,
    "loss_weights": (
        "weigh several outputs' losses in a loss of your own: loss(y_true, y_pred) -> "
        "w1 * loss1 + w2 * loss2, for dict or tuple outputs"
    ),
    "weighted_metrics": "per-example weights go into y, for metrics of your own that read them",
    "from_logits": (
        "the built-in cross-entropy losses take logits (the model's output before a softmax "
        "or sigmoid), as optax's do; end the model without one"
    ),
    "sample_weight": _WEIGHTS,
}

# Keras `fit` keywords given to fl.data.arrays, which stands for fit(x, y, batch_size=...).
ARRAYS_ADVICE: Mapping[str, str] = {
    "sample_weight": _WEIGHTS,
    "class_weight": _WEIGHTS + ", a class's weight looked up by the label: weights[y]",
    "epochs": _EPOCHS,
    "validation_split": RUN_ADVICE["validation_split"],
}

# Keras `compile`/`evaluate` keywords given to fl.evaluator (which trains nothing).
EVALUATOR_ADVICE: Mapping[str, str] = {
    POSITIONAL: 'metrics are added to the loop this returns: .metric("accuracy")',
    "metrics": FACTORY_ADVICE["metrics"],
    "batch_size": _BATCH + " to run()",
    "verbose": "run(progress=True) shows a bar",
    "steps": "iterations go to the run: loop.run(data, params, iterations=N)",
    "learning_rate": "an evaluator trains nothing: the rate is the optimizer's, in fl.trainer",
}


_VERBOSE = "run(progress=True) shows a bar, and loop.log(...) writes lines"
_OWN_HANDLER = (
    "a handler of your own can: loop.handle_event('epoch_completed', fn), fn returning "
    "'halt_loop' to stop"
)
_NO_FILE_NAME = "the path is the first argument: {method}(path)"

# Keras callbacks' keywords given to the Loop's builders, by builder.
HANDLER_ADVICE: Mapping[str, Mapping[str, str]] = {
    "early_stop": {
        "restore_best_weights": "restore_best=True ends the run with the best epoch's weights",
        "baseline": "early_stop judges improvement against the best value seen; " + _OWN_HANDLER,
        "start_from_epoch": "early_stop watches every epoch; " + _OWN_HANDLER,
        "verbose": _VERBOSE,
    },
    "reduce_lr_on_plateau": {"epsilon": "it is min_delta= here", "verbose": _VERBOSE},
    "checkpoint": {
        "monitor": "criteria='validation_loss' (and mode=) saves where that metric improves",
        "save_best_only": "criteria='<metric>' with keep=1 keeps only the best save",
        "save_weights_only": (
            "a save holds the whole State (weights, optimizer state, counters, history); "
            "fl.load_state(path).params are the weights"
        ),
        "save_freq": 'filter={"every": N} saves every N epochs',
        "filepath": _NO_FILE_NAME.format(method="checkpoint"),
        "verbose": _VERBOSE,
    },
    "csv_log": {
        "filename": _NO_FILE_NAME.format(method="csv_log"),
        "append": (
            "a run resumed from a State keeps the file's rows of its earlier epochs and "
            "goes on; a fresh run writes the file anew"
        ),
        "separator": "the file is comma-separated",
    },
    "validate": {
        "validation_freq": 'filter={"every": N} validates every N epochs',
        "batch_size": (
            "the validation data is batched before: fl.data.arrays(x_val, y_val, "
            "batch_size=32, shuffle=False, drop_remainder=False)"
        ),
        "validation_steps": "iterations are the data's: give the validation data you want",
        TOO_FEW: (
            "it takes the model to evaluate, then the validation data (Keras's "
            "validation_data): loop.validate(model, val_data), usually the trainer's model"
        ),
    },
}


_MC_DROPOUT = (
    "predict evaluates (dropout off, BatchNorm's running statistics); for samples with "
    "dropout on (Monte Carlo dropout) use the trained model, m = fl.models.trained(model, "
    "state): where its layers read their own mode, switch dropout alone, "
    "m.set_attributes(deterministic=False) for nnx (m.eval() switches back), "
    "eqx.nn.inference_mode(m, False) for equinox (called with a key, under eqx.filter_jit); "
    "where its __call__ takes a train flag, pass it (it switches every layer it drives, "
    "BatchNorm too: give dropout a flag of its own); for linen, model.apply(state.params, "
    "x, rngs={'dropout': key}) with the module's dropout flag"
)
PREDICT_ADVICE: Mapping[str, str] = {
    **dict.fromkeys(
        ("train", "training", "is_training", "deterministic", "inference", "mode"), _MC_DROPOUT
    ),
    **dict.fromkeys(("rngs", "rng", "key", "dropout_rng", "mc_dropout"), _MC_DROPOUT),
    "verbose": "predict prints nothing",
    "steps": "predict reads every example of x: give it the rows to predict (x[:n])",
}


def advise_foreign_keywords(
    advice: Mapping[str, str], owner: str | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Wraps a public function so a keyword it does not take raises a TypeError that says
    what fuseloop calls it (from `advice`), or the close spelling it takes. `owner`: the
    class a method is called on (`Loop` for a builder its base class defines)."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        parameters = inspect.signature(function).parameters
        accepted = frozenset(parameters)
        positional = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in parameters.values())
        required = [n for n, p in parameters.items() if p.default is p.empty and n != "self"]
        name = function.__qualname__ if owner is None else f"{owner}.{function.__name__}"

        @functools.wraps(function)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            if not kwargs.keys() <= accepted:
                raise _refusal(name, sorted(kwargs.keys() - accepted), accepted, advice)
            if len(args) > positional and POSITIONAL in advice:
                raise TypeError(
                    f"{name}() takes at most {positional} positional arguments but "
                    f"{len(args)} were given: {advice[POSITIONAL]}"
                )
            if TOO_FEW in advice:
                given = set(required[: len(args) - ("self" in parameters)]) | kwargs.keys()
                missing = [n for n in required if n not in given]
                if missing:
                    raise TypeError(f"{name}() is missing {missing[0]!r}: {advice[TOO_FEW]}")
            return function(*args, **kwargs)

        return checked

    return decorate


def _refusal(
    name: str, unknown: list[str], accepted: frozenset[str], advice: Mapping[str, str]
) -> TypeError:
    keyword = unknown[0]
    if keyword in advice:
        hint = advice[keyword]
    else:
        takes = sorted(accepted - {"self"})
        close = difflib.get_close_matches(keyword, takes, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(takes)}"
    return TypeError(f"{name}() got an unexpected keyword argument {keyword!r}: {hint}")
