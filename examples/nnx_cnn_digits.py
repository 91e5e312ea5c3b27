"""The digits CNN written with flax.nnx: a module that owns its parameters and state.

fuseloop splits the nnx module into its parameters and the rest of its state (dropout RNG
streams, batch statistics), trains them as plain arrays, and switches the module between
`.train()` and `.eval()` for training and evaluation steps.

    python examples/nnx_cnn_digits.py             # the full run
    python examples/nnx_cnn_digits.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import argparse

import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import fuseloop as fl


class CNN(nnx.Module):
    """Two 3x3 convolutions (the second batch-normalized), dropout and a classifier."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
        self.bn = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.bn(self.conv2(x)))
        x = self.dropout(x.reshape((x.shape[0], -1)))
        return self.head(x)  # logits


def digits_splits(seed: int = 0):
    """Images (n, 8, 8, 1) in [0, 1] and labels, split 60/20/20 into train/val/test."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


def trained_module(model, state):
    """The nnx module holding the trained weights, in eval mode."""
    if hasattr(fl.models, "trained"):
        return fl.models.trained(model, state)
    # fuseloop releases without fl.models.trained: put the arrays back by hand.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(params, state.params["params"])
    nnx.replace_by_pure_dict(rest, state.params["state"])
    module = nnx.merge(graphdef, params, rest)
    module.eval()
    return module


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
    model = CNN(nnx.Rngs(params=0, dropout=1))
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
    module = trained_module(model, state)
    predicted = np.asarray(module(x_test)).argmax(axis=-1)
    test_accuracy = float(np.mean(predicted == y_test))
    print(
        f"{state.status} after {len(state.history)} epochs; last validation accuracy "
        f"{state.metrics['validation_accuracy']:.4f}"
    )
    print(f"test accuracy: {test_accuracy:.4f} on {len(y_test)} unseen digits")
    return {"state": state, "test_accuracy": test_accuracy, "predicted": predicted}


if __name__ == "__main__":
    main()
