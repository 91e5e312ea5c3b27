"""Checks of the arguments of the Loop builders and factories: each raises a ValueError
that names the argument and what it accepts."""

from __future__ import annotations

import inspect
import io
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ._arg_types import check_seed_bits, is_int, refuse_deleted_arrays, refuse_signature
from ._population import refuse_population
from ._state import State
from ._step import evaluator_program
from ._step_state_check import _TRAINER_KEYS
from ._warn import warn

__all__ = [
    "check_trainer_options",
    "check_text_stream",
    "check_step_functions",
    "check_init_state",
    "check_handler",
    "warn_unused_seed",
    "refuse_validation_names",
    "refuse_second_validation",
    "kept_evaluation",
]


def check_trainer_options(log: Any, seed: Any, log_stream: Any = None) -> tuple[int, int]:
    """`trainer(log=..., seed=..., log_stream=...)`: a non-negative int, an int, and a
    text stream or None. Returns `(log, seed)` as Python ints (numpy integers, e.g. from a
    config file read by numpy, are accepted)."""
    if not is_int(log) or log < 0:
        raise ValueError(f"log={log!r} must be a non-negative int (0 disables logging)")
    if not is_int(seed):
        raise ValueError(f"seed={seed!r} must be an int")
    if not -(2**63) <= int(seed) < 2**63:  # JAX draws a key from a 64-bit seed under x64
        raise ValueError(f"seed={seed} must be in [-2**63, 2**63), e.g. seed % 2**63")
    check_seed_bits(int(seed))
    check_text_stream(log_stream, "log_stream")
    if log_stream is not None and log == 0:
        raise ValueError(
            f"log_stream={log_stream!r} is given but log=0 writes no log lines: pass "
            f"log=N for a line every N iterations"
        )
    return int(log), int(seed)


def check_text_stream(stream: Any, argument: str) -> None:
    """A stream log lines are written to: None (stdout) or a writable text stream; a file
    opened in binary mode would fail only at the first line."""
    if stream is None:
        return
    writable = getattr(stream, "writable", None)
    if not callable(getattr(stream, "write", None)) or (
        callable(writable) and not _writable(stream)
    ):
        raise ValueError(
            f"{argument}={stream!r} must be a text stream open for writing (with "
            f".write), e.g. open(path, 'w') or sys.stderr, or None for stdout"
        )
    if isinstance(stream, (io.RawIOBase, io.BufferedIOBase)) or "b" in str(
        getattr(stream, "mode", "")
    ):
        raise ValueError(
            f"{argument}={stream!r} is opened in binary mode; log lines are text: open it "
            f"with open(path, 'w') (or 'a')"
        )


def _writable(stream: Any) -> bool:
    """Whether an io stream says it is open for writing (sys.stdin is not; a closed file
    raises ValueError when asked)."""
    try:
        return bool(stream.writable())
    except ValueError:
        return False


def check_step_functions(step_fn: Any, init_fn: Callable[..., Any] | None) -> None:
    """`loop(step_fn, init_fn)`: a callable and None or a callable."""
    if not callable(step_fn):
        raise ValueError(f"step_fn={step_fn!r} must be callable(batch, step_state)")
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"init_fn={init_fn!r} must be callable(first_batch, init_state)")
    try:
        refuse_signature(step_fn, "step_fn", "step_fn(batch, step_state)")
    except ValueError as error:
        if _required_positionals(step_fn) == 3:  # Lightning's (batch, batch_idx) habit
            error.add_note(
                "fuseloop: fl.loop passes no batch index; count the steps in the step "
                "state (e.g. {**state, 'step': state['step'] + 1}), or read "
                "state.iteration in a handler"
            )
        raise
    if init_fn is not None:
        refuse_signature(init_fn, "init_fn", "init_fn(first_batch, init_state)")


def _required_positionals(fn: Any) -> int | None:
    """How many positional parameters `fn` requires (None where its signature is not
    readable)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in parameters)


def check_init_state(
    init_state: Any, kind: str = "custom", population: Any = None, data: Any = None
) -> None:
    """`run`'s init_state: a path is refused with the call that loads it; an integer (a
    seed, as a custom loop's init_fn may take) given to a trainer or evaluator, whose state
    is variables, is refused naming the seed's place; a population's State, where no
    `population` is given, is refused by any loop but a trainer (which resumes it).

    Example:
        >>> check_init_state("ckpt/run1")
        Traceback (most recent call last):
        ...
        ValueError: init_state='ckpt/run1' is a path, not a State: load it first, ...
    """
    if isinstance(init_state, (str, bytes, os.PathLike)):
        raise ValueError(
            f"init_state={init_state!r} is a path, not a State: load it first, "
            f"loop.run(data, fl.load_state(path), epochs=...)"
        )
    if isinstance(init_state, State) and init_state.step_state is None:
        raise ValueError(
            "init_state: this State holds no step state (a run stopped before its first "
            "step, by Ctrl-C or an error while it started, leaves none, and so does the "
            "State an iteration handler gets in a fused run, or an observer after a "
            "dispatch of several epochs): run without it to start afresh, or resume from "
            "a State saved at an epoch's end by a handler (Loop.handle_event) or "
            "Loop.checkpoint"
        )
    refuse_deleted_arrays(getattr(init_state, "step_state", init_state), "init_state")
    if is_int(init_state) and kind in _STARTS_FROM:
        epochs = f". For {init_state} epochs: run(data, epochs={init_state})" * bool(init_state > 0)
        raise ValueError(
            f"init_state={init_state!r} is an integer, but {_STARTS_FROM[kind]}{epochs}"
        )
    rows = _rows(data) if kind in _STARTS_FROM else None
    if rows is not None and rows == _rows(init_state):
        raise ValueError(  # Keras's fit(x, y): y landed where the variables go
            f"init_state is an array of {rows} rows, as many as the data's: "
            f"run(x, y) passes y as the initial state. run takes one data source: "
            f"run(fl.data.arrays(x, y, batch_size=...), epochs=...)"
        )
    if kind in _STARTS_FROM and all(hasattr(init_state, a) for a in _TRAIN_STATE):
        fresh = "; its optimizer state starts afresh" if kind == "trainer" else ""
        raise ValueError(
            f"init_state: {type(init_state).__name__} is a hand loop's train state (flax's "
            f"TrainState: params, opt_state, step, apply_fn, tx), and an fl.{kind}() run "
            f"starts from the model's variables or a fuseloop State: pass its variables, "
            f"{_variables_of(init_state)} (or ts.params where it already holds "
            f"{{'params': ...}}){fresh}"
        )
    if kind in _STARTS_FROM and isinstance(init_state, dict) and set(init_state) == _STEP_STATE:
        raise ValueError(
            f"init_state: this dict holds {sorted(_STEP_STATE)}, a trainer's step state "
            f"(state.step_state), not the model's variables: pass the State itself (to "
            f"resume a run, with its optimizer state and counters), or state.params (the "
            f"variables alone)"
        )
    if kind != "trainer" and population is None:
        instead = (
            ", or evaluate every member at once with run(data, state, population={size})"
            if kind == "evaluator"
            else ""
        )
        refuse_population(init_state, "init_state", instead)


def _variables_of(train_state: Any) -> str:
    """The variables dict a train state holds, as code: its params, and the collections it
    keeps beside them (flax's BatchNorm recipe adds `batch_stats`; a mapping field is one)."""
    fields = getattr(train_state, "__dataclass_fields__", {})
    others = [
        name
        for name in fields
        if name not in (*_TRAIN_STATE, "step") and isinstance(getattr(train_state, name), Mapping)
    ]
    return "{" + ", ".join(f"{n!r}: ts.{n}" for n in ("params", *others)) + "}"


def _rows(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    return int(shape[0]) if isinstance(shape, tuple) and shape else None


_STEP_STATE = {"params", *_TRAINER_KEYS}  # a trainer's step state's keys
_TRAIN_STATE = ("params", "opt_state", "apply_fn", "tx")  # flax's TrainState and its kind
_STARTS_FROM = {
    "trainer": "a trainer starts from the model's variables (model.init(...)) or a State; "
    "a trainer's seed is fl.trainer(..., seed=...)",
    "evaluator": "an evaluator starts from the model's variables (model.init(...)) or a State",
}


def refuse_second_validation(clash: set[str]) -> None:
    """A second `validate` adding the names an earlier one adds would overwrite its values
    at every validation, and a monitor attached in between would see the other's: refused.
    """
    if clash:
        names = ", ".join(sorted(clash))
        raise ValueError(
            f"validate: an earlier validate() on this loop already adds {names}; a second "
            f"one would overwrite those values in the history. Validate once on the "
            f"validation data; for a second data set, run fl.evaluator(model, loss) on it "
            f"in an epoch_completed handler that returns the State with metrics under "
            f"names of their own"
        )


def refuse_validation_names(names: set[str], validated: set[str]) -> None:
    """A training metric named like one that `validate` adds would be overwritten by it at
    every validation, without a word: refused, naming both."""
    clash = sorted(names & validated)
    if clash:
        raise ValueError(
            f"metric name {clash[0]!r} is also the name validate() gives the validation "
            f"value of {clash[0].removeprefix('validation_')!r}, which would overwrite it; "
            f"name the training metric otherwise: .metric(..., name=...)"
        )


def check_handler(
    handler: Any, argument: str, returns: str, attached: tuple[Any, ...] = ()
) -> None:
    """A handler is `callable(state)`: refused when attached, not when its event first fires,
    if it is not callable or its signature cannot take the one State it is called with; a
    monitoring handler also if its record's key is one a handler of `attached` (the loop's
    registrations) writes: both would count each epoch in one record."""
    if not callable(handler):
        raise ValueError(f"{argument}={handler!r} must be callable(state) -> {returns}")
    refuse_signature(handler, argument, f"{argument}(state)")
    key = _record_key(handler)
    if key is not None and any(_record_key(r.handler) == key for r in attached):
        kind = type(handler).__name__
        raise ValueError(
            f"{argument}: this {kind} keeps its record under handler_metadata[{key!r}], which "
            f"a handler already attached writes (both would count each epoch in it): give it "
            f"a key of its own, {kind}(..., key={key + '#2'!r})"
        )


def _record_key(handler: Any) -> Any:
    return getattr(getattr(handler, "monitor", None), "key", None)


def describe_loop(loop: Any) -> str:
    """A Loop's repr: its kind, loss, metrics and handlers by event (not its dataclass
    fields: function addresses and internal registrations, kilobytes in a notebook cell).
    """
    parts = [loop.program.kind]
    if loop.program.loss_name:
        parts.append(f"loss={loop.program.loss_name!r}")
    if loop.metrics:
        parts.append(f"metrics={[m.name for m in loop.metrics]}")
    counts: dict[str, dict[str, int]] = {}
    for registration in loop.registrations:
        labels = counts.setdefault(registration.event.value, {})
        label = registration.label.rsplit(".", 1)[-1]
        labels[label] = labels.get(label, 0) + 1
    # A label attached more than once shows its count: a notebook cell run again attaches
    # its handler again, and both act.
    handlers = {
        event: [label if n == 1 else f"{label} x{n}" for label, n in labels.items()]
        for event, labels in counts.items()
    }
    if handlers:
        parts.append(f"handlers={handlers}")
    if loop.guard_nonfinite:
        parts.append("terminate_on_nan")
    return f"Loop({', '.join(parts)})"


def warn_unused_seed(model: Any, seed: int) -> None:
    """`trainer(seed=...)` other than the default, for a model it cannot reach (nnx's)."""
    why = getattr(model, "seed_unused", None)
    if seed != 0 and why is not None:
        warn(
            f"seed={seed} has no effect on this model: {why}. Build the model with "
            f"nnx.Rngs({seed}) to change its initial weights and dropout masks",
            UserWarning,
        )


_MONITOR_CLASSES = {"early_stop": "EarlyStopping", "reduce_lr_on_plateau": "ReduceLROnPlateau"}


def check_monitored(
    registrations: tuple[Any, ...], monitor: str, who: str, fires: Any = None
) -> None:
    """Refuses on attaching what failed only after training: Keras's `val_<name>`, and a
    validation metric validate's filter leaves out of epochs read (`fires`: the Filter)."""
    from .handlers._monitor_record import keras_spelling
    from .handlers.validate import Validator, validation_names

    checkpoint = who == "checkpoint"  # it takes the name as criteria=, after its path
    call = f"checkpoint(path, criteria={monitor!r})" if checkpoint else f"{who}({monitor!r})"
    for registration in registrations:
        if not isinstance(registration.handler, Validator):
            continue
        names = validation_names(registration.handler.loop)
        spelled = keras_spelling(monitor, names, aliases=False)  # val_<name> alone
        if spelled is not None:  # (another spelling may be a name a handler adds)
            said = spelled.replace("; monitor ", "; criteria=") if checkpoint else spelled
            raise ValueError(f"{call}: {said}")
        spec = registration.filter
        every_epoch = spec.every in (None, 1) and spec.before is None and spec.after is None
        always = every_epoch and spec.once is None and not spec.predicate
        if monitor in names and not always and spec != fires:
            handler = _MONITOR_CLASSES.get(who)
            same_filter = (
                f", or attach the handler with validate's filter: loop.handle_event("
                f"'epoch_completed', fl.handlers.monitor.{handler}({monitor!r}, ...), "
                f"filter=...)"
                if handler
                else f", or give it validate's filter: loop.{who}(..., filter=...)"
            )
            raise ValueError(
                f"{call}: validate's filter leaves some epochs without {monitor}, which "
                f"{who} reads at every epoch's end its own filter passes. Validate at every "
                f"epoch{same_filter}"
            )


def kept_evaluation(cache: Any, model: Any, loss: Any, specs: tuple[Any, ...], loop: Any) -> Any:
    """The evaluator Loop `Loop.validate` builds for `model`, the loss and `specs`, kept in
    the trainer's `cache` by identity (a metric may be unhashable); `loop`: the Loop class."""
    key = (id(model), tuple((m.name, id(m.fn), m.accumulate, m.source) for m in specs))
    made = cache.evaluations.get(key, (None, None))
    if made[0] is not model:
        program = replace(evaluator_program(model, loss), data_name="validate()'s data")
        for old in list(cache.evaluations)[:-7]:  # the last 8 kept (a model made per call)
            del cache.evaluations[old]
        made = cache.evaluations[key] = (model, loop(program, metrics=specs))
    return made[1]
