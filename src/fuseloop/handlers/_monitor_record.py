"""The record a monitoring handler keeps: a metric's best value and the epochs since.

`Monitor` watches one metric of `state.metrics`; its record lives in
`state.handler_metadata` under the handler's key, so it is saved with a checkpoint and a
resumed run continues it exactly (`handlers.monitor` builds the handlers on it).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._arg_types import is_int
from .._events import event_total
from .._metrics import ALIASES, LOSSES, METRICS
from .._state import State
from .._warn import warn

__all__ = [
    "MODES",
    "SPELLING",
    "Monitor",
    "at_epoch_end",
    "check_float",
    "check_int",
    "keras_spelling",
    "resolve_mode",
]

MODES = ("min", "max")

# Words of a metric's name that say which way it moves as a model improves. A name is
# read word by word (split at "_", "-", "/", ".", spaces and camelCase; each word also with
# its trailing digits dropped, and joined with the next one or two, so "mean_io_u",
# "MeanIoU" and "log_cosh" are read), so "cauchy_loss" holds no "auc" and
# "accumulated_error" no "acc". Where words of both kinds appear, the last one decides:
# "dice_loss" and "top1_err" fall.
# fmt: off
_RISING_WORDS = frozenset({
    "acc", "accuracy", "precision", "recall", "auc", "roc", "rocauc", "auroc", "auprc",
    "prauc", "f1", "f2", "fbeta", "r2", "iou", "miou", "meaniou", "dice", "jaccard", "map",
    "ap", "ndcg", "mrr", "bleu", "rouge", "psnr", "ssim", "specificity", "sensitivity", "tpr",
    "kappa", "mcc", "correlation", "pearson", "spearman", "explained", "top1", "top5",
    "reward", "rewards", "return", "returns", "elbo",
})
_FALLING_WORDS = frozenset({
    "loss", "losses", "error", "errors", "err", "mse", "mae", "rmse", "mape", "smape", "msle",
    "rmsle", "nll", "crossentropy", "entropy", "xent", "xentropy", "bce", "cce", "logloss",
    "perplexity", "ppl", "hinge", "huber", "logcosh", "distance", "divergence", "kl", "kld",
    "cer", "wer", "fpr", "fnr", "regret", "cost", "risk", "deviance", "brier", "bpd",
    "bitsperdim", "fid", "misclassification", "poisson",
})
# fmt: on
# Words that may negate the rest ("neg_mean_squared_error", scikit-learn's score: higher is
# better) or not ("negative_class_recall"): a name holding one is read neither way.
_NEGATING_WORDS = frozenset({"neg", "negative", "negated", "minus"})


def _words(name: str) -> list[str]:
    """`name`'s words in order, lower case: "validation_R2Score" -> validation, r2, score."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)
    return [word for word in re.split(r"[\W_]+", spaced.lower()) if word]


def _negating_word(words: list[str]) -> str | None:
    """The first of `words` that may negate the rest of a name (`_NEGATING_WORDS`)."""
    return next((word for word in words if word in _NEGATING_WORDS), None)


def _direction(name: Any) -> str | None:
    """ "max" for a name whose words say it rises as a model improves, "min" for one that
    falls (the last such word decides), None for a name that says neither."""
    words = _words(name) if isinstance(name, str) else []
    if _negating_word(words) is not None:
        return None
    found = None
    for i, word in enumerate(words):
        forms = {word, word.rstrip("0123456789"), "".join(words[i : i + 2])}
        forms.add("".join(words[i : i + 3]))
        if forms & _RISING_WORDS:
            found = "max"
        if forms & _FALLING_WORDS:
            found = "min"
    return found


def resolve_mode(mode: Any, name: Any, argument: str, who: str) -> Any:
    """`mode` as "min" or "max". "auto" reads it from the words of the metric's `name`:
    "max" for accuracy, precision, recall, AUC, F1, R2, IoU and the like, "min" for a
    loss, an error, MSE, MAE and the like (of words of both kinds, the last decides), and
    a ValueError naming the fix for a name that says neither (Keras 3 refuses such a name
    too). "min" on a rising name warns: it would count the metric falling as the model
    improving. Any other mode is a ValueError.

    Example:
        >>> resolve_mode("auto", "validation_accuracy", "monitor", "early_stop")
        'max'
        >>> resolve_mode("auto", "validation_cauchy_loss", "monitor", "early_stop")
        'min'
        >>> resolve_mode("auto", "validation_r2", "monitor", "early_stop")
        'max'
    """
    if mode not in MODES and mode != "auto":
        raise _not_a_mode(mode)
    direction = _direction(name)
    negated = _negating_word(_words(name) if isinstance(name, str) else [])
    if mode == "auto":
        if direction is None and name is not None:
            raise ValueError(
                f"{who}({argument}={name!r}, mode='auto'): the name does not say whether "
                f"the metric rises or falls as a model improves (auto reads words such as "
                f"accuracy, auc, f1 or r2 as rising, loss, error, mse or mae as falling"
                f"{f'; {negated!r} may negate the rest of the name, or not' if negated else ''}"
                f"). Pass mode='max' where a higher value is better, mode='min' where lower is"
            )
        return direction or "min"
    if mode == "min" and direction == "max":
        warn(
            f"{who}: {argument}={name!r} rises as a model improves, but mode='min' counts "
            f"a lower value as better, so the worst epochs would count as the best. Pass "
            f"mode='max' (or mode='auto', which reads it from the name)"
        )
    return mode


SPELLING = "fuseloop names a validation metric validation_<name> (Keras's val_<name>)"


def keras_spelling(monitor: Any, names: Any, aliases: bool = True) -> str | None:
    """What to monitor instead where `monitor` names a metric among `names` by another
    spelling: Keras's `val_<name>` (validation adds `validation_<name>`), or (`aliases`)
    the metric's other Keras name (`mean_absolute_error` where it was added as "mae",
    which keeps the key it was given); None where `monitor` is among them or means none
    of them."""
    if not isinstance(monitor, str) or monitor in names:
        return None
    for prefix in ("val_", "validation_"):
        if monitor.startswith(prefix):
            name = monitor.removeprefix(prefix)
            spellings = [name, *(_other_names(name) if aliases else ())]
            ours = next((f"validation_{s}" for s in spellings if f"validation_{s}" in names), None)
            if ours is None:
                return None
            said = [SPELLING] if prefix == "val_" else []
            if ours != f"validation_{name}":
                said.append("the metric keeps the key it was given")
            return f"{', and '.join(said)}; monitor {ours!r}"
    if aliases:  # a training metric's other name: "mean_absolute_error" added as "mae"
        ours = next((s for s in _other_names(monitor) if s in names and s != monitor), None)
        if ours is not None:
            return f"the metric keeps the key it was given; monitor {ours!r}"
    return None


def _other_names(name: str) -> list[str]:
    """A metric's names: the canonical one, then each Keras alias of it."""
    canonical = ALIASES.get(name, name)
    return [canonical, *(k for k, v in ALIASES.items() if v == canonical)]


def _validation_prefix(monitor: str) -> str:
    """The validation prefix `monitor` starts with: fuseloop's, Keras's, or none ("")."""
    return next((p for p in ("validation_", "val_") if monitor.startswith(p)), "")


def _loss_tracked_as(monitor: str, names: Any) -> str | None:
    """Where `monitor` names a built-in loss ("mse", "val_binary_crossentropy"), what to
    monitor instead: a trainer keeps its loss as "loss" (and "validation_loss") whichever
    loss it is, as Keras does; None for any other name, or one a training metric has
    (validation left it out: another message says why). The monitor does not know the
    trainer's loss, so the advice says which case is which."""
    prefix = _validation_prefix(monitor)
    name = monitor.removeprefix(prefix)
    if ALIASES.get(name, name) not in LOSSES or name in names:  # a metric of that name
        return None
    ours = "validation_loss" if prefix else "loss"
    if ours not in names:
        return None
    said = (
        f"where {name!r} is the trainer's loss, it is kept as 'loss' (and "
        f"'validation_loss' in validation) whichever loss it is: monitor {ours!r}"
    )
    if ALIASES.get(name, name) not in METRICS:
        return f"{said}; for another loss, track it with a metric of your own"
    before = " before Loop.validate(...)" if prefix else ""
    return f"{said}; to track it as well, attach Loop.metric({name!r}){before}"


def _misspelt(monitor: str, names: Any) -> str | None:
    """The metric among `names` that `monitor` misspells, compared within its kind: a
    validation name's part after the prefix with the validation metrics' (another
    metric's validation, such as mae for mse, is not a typo of it), a training name with
    the training metrics, then whole (a misspelt prefix: "validaton_loss")."""
    prefix = _validation_prefix(monitor)
    kind = {n.removeprefix("validation_"): n for n in names if n.startswith("validation_")}
    if not prefix:
        kind = {n: n for n in names if not n.startswith("validation_")}
    close = difflib.get_close_matches(monitor.removeprefix(prefix), list(kind), 1, 0.8)
    if close:
        return str(kind[close[0]])
    if prefix:  # a validation name: only its own kind can be what it misspells
        return None
    whole: list[str] = difflib.get_close_matches(monitor, list(names), 1, 0.85)
    return whole[0] if whole else None  # a misspelt prefix


def _not_a_mode(mode: Any) -> ValueError:
    return ValueError(f"mode={mode!r} is not a mode; accepted values: {', '.join(MODES)}, auto")


def check_int(value: Any, argument: str, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{argument}={value!r} must be an int >= {minimum}")
    return int(value)


def check_float(
    value: Any,
    argument: str,
    minimum: float,
    maximum: float = math.inf,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    low_ok: Callable[[float], bool] = (
        (lambda v: v > minimum) if open_low else (lambda v: v >= minimum)
    )
    high_ok: Callable[[float], bool] = (
        (lambda v: v < maximum) if open_high else (lambda v: v <= maximum)
    )
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{argument}={value!r} must be a number")
    number = float(value)
    if not (math.isfinite(number) and low_ok(number) and high_ok(number)):
        low = "(" if open_low else "["
        high = ")" if open_high else "]"
        raise ValueError(f"{argument}={number!r} must be in {low}{minimum}, {maximum}{high}")
    return number


@dataclass(frozen=True)
class Monitor:
    """Watches `state.metrics[monitor]` and tracks its best value.

    Attributes:
        monitor: The metric's name, e.g. "validation_loss".
        mode: "min" (lower is better) or "max" (`resolve_mode` reads "auto").
        patience: Epochs without improvement a handler tolerates (>= 0).
        min_delta: The smallest change that counts as an improvement (>= 0), as Keras 3
            compares it: `value + min_delta < best` (mode "max": `value - min_delta > best`).
        key: Where the record lives in `state.handler_metadata`.
        argument: The handler argument that named the metric, for messages.

    Example:
        >>> m = Monitor("loss", mode="min", patience=2, key="doc")
        >>> record, improved = m.update(m.record(State()), 0.5)
        >>> improved, record["best"], record["wait"]
        (True, 0.5, 0)
    """

    monitor: str
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0
    key: str = ""
    argument: str = "monitor"  # the handler's name for it, in messages ("criteria")

    def __post_init__(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ValueError(
                f"{self.argument}={self.monitor!r} must be a metric name such as "
                f"'loss' or 'validation_loss'"
            )
        if self.mode not in MODES:
            raise _not_a_mode(self.mode)
        object.__setattr__(self, "patience", check_int(self.patience, "patience", 0))
        object.__setattr__(self, "min_delta", check_float(self.min_delta, "min_delta", 0.0))
        if not self.key:
            object.__setattr__(self, "key", f"monitor:{self.monitor}")

    def value(self, state: State) -> float:
        """The monitored value of this epoch, or a ValueError naming the metrics there are."""
        if self.monitor not in state.metrics:
            available = ", ".join(sorted(state.metrics)) or "(none)"
            spelled = keras_spelling(self.monitor, state.metrics)
            if spelled is not None:
                raise ValueError(
                    f"{self.argument}={self.monitor!r} is not among this epoch's metrics "
                    f"({available}): {spelled}"
                )
            close = _misspelt(self.monitor, state.metrics)
            if close is not None:  # a typo of a metric the epoch has: no Loop.metric adds it
                raise ValueError(
                    f"{self.argument}={self.monitor!r} is not among this epoch's metrics "
                    f"({available}); did you mean {close!r}? Monitor {close!r}"
                )
            tracked_as = _loss_tracked_as(self.monitor, state.metrics)
            if tracked_as is not None:
                raise ValueError(
                    f"{self.argument}={self.monitor!r} is not among this epoch's metrics "
                    f"({available}): {tracked_as}"
                )
            name = self.monitor.removeprefix("validation_")
            validated = sorted(k for k in state.metrics if k.startswith("validation_"))
            if name != self.monitor and validated:
                raise self._not_validated(name, validated, available)
            keras = f" ({SPELLING})" if self.monitor.startswith("val_") else ""
            raise ValueError(
                f"{self.argument}={self.monitor!r} is not among this epoch's metrics "
                f"({available}){keras}. Add it with Loop.metric(...), or, for 'validation_*', "
                f"attach Loop.validate(...) before the handler that monitors it, validating "
                f"at every epoch the handler runs (a validate filter such as {{'every': 2}} "
                f"leaves the other epochs without validation metrics: validate at every "
                f"epoch, or monitor a training metric)"
            )
        try:
            return float(np.asarray(state.metrics[self.monitor]).item())
        except (TypeError, ValueError):
            raise ValueError(
                f"{self.argument}={self.monitor!r}: the metric is not a scalar "
                f"({state.metrics[self.monitor]!r}); monitor a scalar metric"
            ) from None

    def _not_validated(self, name: str, validated: list[str], available: str) -> ValueError:
        """The error for a `validation_<name>` validation did not compute, naming why."""
        said = f"{self.argument}={self.monitor!r} is not among this epoch's metrics ({available})"
        return ValueError(
            f"{said}: validation computed {', '.join(map(repr, validated))}, not {name!r}. "
            f"It computes the metrics attached before Loop.validate: attach "
            f"Loop.metric({name!r}) before it. Where it is attached before already, "
            f"validation cannot compute it (a custom loop's loss, or a metric of its step "
            f"state, lives in its step, which an evaluator does not run): monitor one of "
            f"those"
        )

    def record(self, state: State) -> dict[str, Any]:
        """This monitor's record in `state.handler_metadata` (a fresh one if absent)."""
        saved = state.handler_metadata.get(self.key)
        if saved is None:
            return {"best": None, "best_epoch": None, "wait": 0}
        return dict(saved)

    def improves(self, value: float, best: float | None) -> bool:
        """Whether `value` beats `best` by more than `min_delta` (non-finite never does)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        # Keras 3's `monitor_op(value - min_delta, best)`, min_delta negated in mode "min"
        if self.mode == "min":
            return value + self.min_delta < best
        return value - self.min_delta > best

    def update(
        self, record: dict[str, Any], value: float, epoch: int | None = None
    ) -> tuple[dict[str, Any], bool]:
        """The record after seeing `value`, and whether it improved."""
        record = dict(record)
        if self.improves(value, record["best"]):
            record.update(best=value, best_epoch=epoch, wait=0)
            return record, True
        record["wait"] += 1
        return record, False

    def warn_not_finite(self, value: float, epoch: int, members: str = "") -> None:
        """The warning of an early stop on a NaN or inf value, which halts at once. A
        validation metric that is not finite while the training loss is usually reads
        validation data holding NaN or inf."""
        warn(
            f"early_stop: {self.monitor} is {value} at epoch {epoch}{members}, not a finite "
            f"number, so the run halts {'those members ' if members else ''}at once. "
            + (
                f"If the training loss is finite, look for NaN or inf in the data "
                f"{self.monitor} is computed on (np.isfinite(x).all() is False there)"
                if self.monitor.startswith("validation_")
                else "Training diverged or its data holds NaN or inf: try a lower learning "
                "rate, and loop.terminate_on_nan() to stop at the first such step"
            ),
            RuntimeWarning,
        )

    def store(self, state: State, record: dict[str, Any]) -> State:
        """`state` with `record` kept in its handler metadata under this monitor's key."""
        return state.replace(handler_metadata={**state.handler_metadata, self.key: record})


def at_epoch_end(state: State) -> bool:
    """Whether a resumed run's State left off at its last epoch's end.

    Every epoch it started ended; a State halted inside an epoch starts that epoch again.
    """
    counts = state.event_counts
    ended = event_total(counts, "epoch_completed") + event_total(counts, "epoch_halted")
    return event_total(counts, "epoch_started") == ended
