"""`fuseloop demo`: an MLP on scikit-learn's digits (real data shipped with the package)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import optax

from ._types import Fuse

__all__ = ["default_plot_path", "demo", "digits_split", "parse_fuse"]


def digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 8x8 digits, scaled to [0, 1], split 80/20 into train and held-out sets."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def parse_fuse(fuse: str) -> Fuse:
    """`--fuse` as `run` takes it: a positive chunk size, "auto", "true" or "false".

    Example:
        >>> parse_fuse("16"), parse_fuse("false"), parse_fuse("auto")
        (16, False, 'auto')
    """
    text = fuse.strip().lower()
    if text in ("false", "no", "off"):
        return False
    if text in ("auto", "true"):
        return "auto" if text == "auto" else True
    if text.isascii() and text.isdigit() and int(text) >= 1:  # not "²" or "٣"
        return int(text)
    raise ValueError(
        f"--fuse={fuse!r}: use a positive chunk size (e.g. 32), 'auto', 'true' (chunks of "
        f"32) or 'false' (unfused)"
    )


def _log_epoch(state: Any) -> None:
    """One line per epoch, written above the progress bar (never into it)."""
    from .handlers.log import SEPARATOR, epoch_label, format_metrics
    from .handlers.progress import write_above_bars

    line = SEPARATOR.join(
        (epoch_label(state.epoch, state.max_epoch), format_metrics(state.metrics))
    )
    write_above_bars(line + "\n", sys.stdout)


def default_plot_path() -> Path:
    """Where `fuseloop demo` writes its plot unless told: the system's temporary folder
    (never the current directory, which may be a repository)."""
    return Path(tempfile.gettempdir()) / "fuseloop-demo" / "history.png"


def _plot_target(plot: str | os.PathLike[str] | bool | None) -> Path | None:
    if plot is None or plot is False:
        return None
    if plot is True:
        return default_plot_path()
    if not isinstance(plot, (str, os.PathLike)) or not str(plot):
        raise ValueError(
            f"plot={plot!r} must be a file path, True (the default location "
            f"{default_plot_path()}) or False/None (no plot)"
        )
    return Path(plot).expanduser().resolve()


def _even_batch(n: int, at_most: int = 64) -> int:
    """The largest batch size <= at_most that divides n, so evaluation has no ragged batch."""
    return max(b for b in range(1, min(n, at_most) + 1) if n % b == 0)


def demo(
    epochs: int = 20,
    fuse: str = "32",
    plot: str | os.PathLike[str] | bool | None = True,
    progress: bool = True,
) -> int:
    """Trains an MLP on digits with a held-out split and prints the validation accuracy.

    Args:
        epochs: Epochs to train (early stopping may end sooner).
        fuse: A chunk size, "auto", "true" or "false".
        plot: Where to write the PNG of the metric curves: a path, True for
            `default_plot_path()`, False or None for no plot. The path is printed.
        progress: Show the progress display.

    Returns:
        The exit status: 0 when the validation accuracy reaches 0.9, 1 below it; 130 (143)
        when Ctrl-C (SIGTERM) halted the run.

    Example:
        >>> demo(epochs=1, plot=False, progress=False)  # 1 epoch does not reach 0.9
        fuseloop demo: digits, 1437 train / 360 held-out examples, MLP 64-128-10, 1 epoch, fuse=32
        Epoch 1/1 - loss: ...
        final validation accuracy: ...
        exit status 1: the validation accuracy is below the demo's bar of 0.9
        1
    """
    import fuseloop as fl

    target = _plot_target(plot)
    x_train, y_train, x_val, y_val = digits_split()
    train = fl.data.arrays(x_train, y_train, batch_size=32, shuffle=True, seed=0)
    val = fl.data.arrays(x_val, y_val, batch_size=_even_batch(len(x_val)), shuffle=False)
    model = fl.models.mlp([128, 10])
    print(
        f"fuseloop demo: digits, {len(x_train)} train / {len(x_val)} held-out examples, "
        f"MLP 64-128-10, {epochs} epoch{'s' if epochs != 1 else ''}, fuse={fuse}"
    )
    if target is not None:
        print(f"the plot of the metric curves will be written to {target}")
    loop = _demo_loop(model, val, progress)
    began = time.perf_counter()
    state = loop.run(train, epochs=epochs, fuse=parse_fuse(fuse), progress=progress)
    wall = time.perf_counter() - began
    stopped_by = state.stats.get("signal")  # Ctrl-C (SIGINT) or SIGTERM halted the run
    interrupted = 143 if stopped_by == "SIGTERM" else 130  # the shell's 128 + signal
    validated = [e for e, row in state.history.items() if "validation_accuracy" in row]
    if not validated:  # a signal halted the first epoch before its validation
        print("fuseloop demo: interrupted before the first epoch was validated")
        return interrupted
    accuracy = state.history[validated[-1]]["validation_accuracy"]
    print(
        f"final validation accuracy: {accuracy:.4f} ({state.status} after "
        f"{state.epoch + 1} epoch{'s' if state.epoch else ''}, wall time {wall:.2f} s, "
        f"{state.stats['dispatches']} dispatches, chunk size {state.stats['chunk_size']})"
    )
    if target is not None:
        _write_plot(state, target)
    if stopped_by is not None:
        print(
            f"fuseloop demo: interrupted by {stopped_by}; the accuracy is epoch "
            f"{validated[-1] + 1}'s"
        )
        return interrupted
    if accuracy < 0.9:
        print("exit status 1: the validation accuracy is below the demo's bar of 0.9")
        return 1
    return 0


def _demo_loop(model: Any, val: Any, progress: bool) -> Any:
    """The demo's trainer: accuracy, validation, early stopping; a line per epoch unless
    the progress display shows them."""
    import fuseloop as fl

    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-3))
        .metric("accuracy")
        .validate(model, val)
    )
    if not progress:  # the progress display already shows each epoch's metrics
        # Before early_stop: the handler that halts stops the ones after it, and the
        # epoch it halts at gets its line too.
        loop = loop.handle_event("epoch_completed", _log_epoch, name="demo_log")
    return loop.early_stop("validation_loss", patience=5)


def _write_plot(state: Any, target: Any) -> None:
    import fuseloop as fl

    try:
        fl.plot_history(state.history, target)
        print(f"metric curves written to {target}")
    except (ImportError, OSError, ValueError) as error:  # no matplotlib; a path it cannot write
        print(f"no plot: {error}")
