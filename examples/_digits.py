"""What the three digits CNN examples share: the data splits, the command line, the training
run and the report. Not an example of its own: `linen_cnn_digits.py`, `nnx_cnn_digits.py`
and `equinox_cnn_digits.py` import it (Python finds it beside the script it runs).
"""

from __future__ import annotations

import argparse

import numpy as np
import optax
from _args import at_least
from sklearn.datasets import load_digits

import fuseloop as fl


def digits_splits(seed: int = 0, channels_first: bool = False):
    """Images in [0, 1] and labels, split 60/20/20 into train/val/test.

    Images are (n, 8, 8, 1), or (n, 1, 8, 8) with `channels_first` (as equinox
    convolutions expect).
    """
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    x = images[:, None] if channels_first else images[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


def parse(doc: str, argv=None):
    """The examples' command line; `doc` is the example's docstring (its first line is the
    description)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--epochs", type=at_least(1), default=40)
    parser.add_argument("--quick", action="store_true", help="2 epochs of 4 iterations")
    parser.add_argument("--fuse", type=at_least(0), default=16, help="chunk size (0: unfused)")
    parser.add_argument("--log", type=at_least(0), default=0, help="a log line every N iterations")
    parser.add_argument("--progress", action="store_true")
    return parser.parse_args(argv)


def train(model, args, train_split, val_split) -> fl.State:
    """Trains `model` with Adam, validating each epoch and stopping early on the validation
    loss; `args` from `parse` set the epochs, the chunk size, logging and progress."""
    train_data = fl.data.arrays(*train_split, batch_size=32, shuffle=True, seed=0)
    val = fl.data.arrays(*val_split, batch_size=120, shuffle=False, drop_remainder=False)
    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(2e-3), log=args.log)
        .metric("accuracy")
        .validate(model, val)
        .early_stop("validation_loss", patience=5)
    )
    epochs, iterations = (2, 4) if args.quick else (args.epochs, None)
    return loop.run(
        train_data,
        epochs=epochs,
        iterations=iterations,
        fuse=args.fuse or False,
        progress=args.progress,
    )


def report(state: fl.State, predicted, y_test, summary: str) -> dict:
    """Prints how the run ended (with `summary`) and the test accuracy; returns both."""
    test_accuracy = float(np.mean(predicted == y_test))
    print(f"{state.status} after {len(state.history)} epochs; {summary}")
    print(f"test accuracy: {test_accuracy:.4f} on {len(y_test)} unseen digits")
    return {"state": state, "test_accuracy": test_accuracy, "predicted": predicted}
