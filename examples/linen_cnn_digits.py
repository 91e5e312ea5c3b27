"""A convolutional network on scikit-learn's 8x8 digits, written with flax.linen.

Conv + BatchNorm + Dropout, a validation split watched by early stopping, and predictions
on a test split the training never saw. The module's `train` argument switches Dropout and
BatchNorm between training and evaluation; fuseloop passes `train=True` (with a dropout
key) in training steps and `train=False` when it validates or predicts.

    python examples/linen_cnn_digits.py             # the full run (about 40 epochs at most)
    python examples/linen_cnn_digits.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import numpy as np
import optax
from sklearn.datasets import load_digits

import fuseloop as fl


class CNN(nn.Module):
    """Two 3x3 convolutions with batch normalization, then dropout and a classifier."""

    @nn.compact
    def __call__(self, x, train: bool):
        for features, stride in ((16, 1), (32, 2)):
            x = nn.Conv(features, (3, 3), strides=stride)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(10)(x)  # logits


def digits_splits(seed: int = 0):
    """Images (n, 8, 8, 1) in [0, 1] and labels, split 60/20/20 into train/val/test."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


def predict_logits(model, state, x):
    """The model's eval-mode outputs for every row of x."""
    if hasattr(fl, "predict"):
        return np.asarray(fl.predict(model, state, x, batch_size=256))
    # fuseloop releases without fl.predict: apply the trained variables directly.
    return np.asarray(model.apply(state.params, x, train=False))


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="2 epochs of 4 iterations")
    parser.add_argument("--fuse", type=int, default=16, help="chunk size (0: unfused)")
    parser.add_argument("--log", type=int, default=0, help="a log line every N iterations")
    parser.add_argument("--progress", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    (x_train, y_train), (x_val, y_val), (x_test, y_test) = digits_splits()
    train = fl.data.arrays(x_train, y_train, batch_size=32, shuffle=True, seed=0)
    val = fl.data.arrays(x_val, y_val, batch_size=120, shuffle=False)
    model = CNN()
    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(2e-3), log=args.log)
        .metric("accuracy")
        .validate(model, val)
        .early_stop("validation_loss", patience=5)
    )
    epochs, iterations = (2, 4) if args.quick else (args.epochs, None)
    state = loop.run(
        train, epochs=epochs, iterations=iterations, fuse=args.fuse or False, progress=args.progress
    )
    best = min(state.history, key=lambda e: state.history[e]["validation_loss"])
    predicted = predict_logits(model, state, x_test).argmax(axis=-1)
    test_accuracy = float(np.mean(predicted == y_test))
    print(
        f"{state.status} after {len(state.history)} epochs; best validation loss "
        f"{state.history[best]['validation_loss']:.4f} at epoch {best + 1}"
    )
    print(f"test accuracy: {test_accuracy:.4f} on {len(y_test)} unseen digits")
    return {"state": state, "test_accuracy": test_accuracy, "predicted": predicted}


if __name__ == "__main__":
    main()
