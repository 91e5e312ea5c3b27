"""`fuseloop demo`: an MLP on scikit-learn's digits (real data shipped with the package)."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import optax

__all__ = ["demo", "digits_split"]


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


def _parse_fuse(fuse: str) -> bool | int | str:
    if fuse.lower() in ("false", "0", "no", "off"):
        return False
    if fuse == "auto":
        return "auto"
    if fuse.lower() == "true":
        return True
    try:
        return int(fuse)
    except ValueError:
        raise ValueError(f"--fuse={fuse!r}: use a chunk size, 'auto', 'true' or 'false'") from None


def _log_epoch(state: Any) -> None:
    """One line per epoch; `tqdm.write` keeps it from colliding with the progress bar."""
    from tqdm.auto import tqdm

    from .handlers.log import format_metrics

    tqdm.write(f"Epoch: {state.epoch}, {format_metrics(state.metrics)}", file=sys.stdout)


def demo(epochs: int = 20, fuse: str = "32", plot: str | None = "demo_history.png",
         progress: bool = True) -> int:
    """Trains an MLP on digits with a held-out split and prints the validation accuracy.

    Example:
        >>> demo(epochs=1, plot=None, progress=False)  # doctest: +SKIP
    """
    import fuseloop as fl

    x_train, y_train, x_val, y_val = digits_split()
    train = fl.data.arrays(x_train, y_train, batch_size=32, shuffle=True, seed=0)
    val = fl.data.arrays(x_val, y_val, batch_size=32, shuffle=False, drop_remainder=False)
    model = fl.models.mlp([128, 10])
    print(f"fuseloop demo: digits, {len(x_train)} train / {len(x_val)} held-out examples, "
          f"MLP 64-128-10, {epochs} epochs, fuse={fuse}")
    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-3))
        .metric("accuracy")
        .validate(model, val)
        .early_stop("validation_loss", patience=5)
        .handle_event("epoch_completed", _log_epoch, name="demo_log")
    )
    began = time.perf_counter()
    state = loop.run(train, epochs=epochs, fuse=_parse_fuse(fuse), progress=progress)
    wall = time.perf_counter() - began
    accuracy = state.metrics["validation_accuracy"]
    print(f"final validation accuracy: {accuracy:.4f} ({state.status} after "
          f"{state.epoch + 1} epochs, wall time {wall:.2f} s, "
          f"{state.stats['dispatches']} dispatches, chunk size {state.stats['chunk_size']})")
    if plot:
        try:
            fl.plot_history(state.history, plot)
            print(f"metric curves written to {plot}")
        except ImportError as error:
            print(f"no plot: {error}")
    return 0 if accuracy >= 0.9 else 1
