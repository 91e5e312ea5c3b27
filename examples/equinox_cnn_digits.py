"""The digits CNN written with equinox: the model is a pytree of arrays.

fuseloop applies an equinox module to one example at a time (vmapped over the batch) and
passes a per-example `key` in training steps only, so `key is None` means evaluation:
Dropout is then the identity.

    python examples/equinox_cnn_digits.py             # the full run
    python examples/equinox_cnn_digits.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

import fuseloop as fl


class CNN(eqx.Module):
    """Two 3x3 convolutions, dropout and a classifier, for one (1, 8, 8) image."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(16, 32, 3, stride=2, padding=1, key=k2)
        self.dropout = eqx.nn.Dropout(0.3)
        self.head = eqx.nn.Linear(32 * 4 * 4, 10, key=k3)

    def __call__(self, x, key=None):
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        x = self.dropout(x.reshape(-1), key=key, inference=key is None)
        return self.head(x)  # logits


def digits_splits(seed: int = 0):
    """Images (n, 1, 8, 8) in [0, 1] (channels first, as equinox convolutions expect) and
    labels, split 60/20/20 into train/val/test."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


def trained_module(model, state):
    """The equinox module holding the trained weights, in inference mode."""
    if hasattr(fl.models, "trained"):
        return fl.models.trained(model, state)
    # fuseloop releases without fl.models.trained: combine the arrays with the static part.
    _, static = eqx.partition(model, eqx.is_inexact_array)
    return eqx.nn.inference_mode(eqx.combine(state.params["params"], static))


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
    model = CNN(jax.random.PRNGKey(0))
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
    predicted = np.asarray(jax.vmap(module)(x_test)).argmax(axis=-1)
    test_accuracy = float(np.mean(predicted == y_test))
    print(
        f"{state.status} after {len(state.history)} epochs; last validation accuracy "
        f"{state.metrics['validation_accuracy']:.4f}"
    )
    print(f"test accuracy: {test_accuracy:.4f} on {len(y_test)} unseen digits")
    return {"state": state, "test_accuracy": test_accuracy, "predicted": predicted}


if __name__ == "__main__":
    main()
