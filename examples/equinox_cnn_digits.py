"""The digits CNN written with equinox: the model is a pytree of arrays.

fuseloop applies an equinox module to one example at a time (vmapped over the batch) and
passes a per-example `key` in training steps only, so `key is None` means evaluation:
Dropout is then the identity.

    python examples/equinox_cnn_digits.py             # the full run
    python examples/equinox_cnn_digits.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from _digits import digits_splits, parse, report, train

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


def trained_module(model, state):
    """The equinox module holding the trained weights, in inference mode."""
    if hasattr(fl.models, "trained"):
        return fl.models.trained(model, state)
    # fuseloop releases without fl.models.trained: combine the arrays with the static part.
    _, static = eqx.partition(model, eqx.is_inexact_array)
    return eqx.nn.inference_mode(eqx.combine(state.params["params"], static))


def main(argv=None) -> dict:
    args = parse(__doc__, argv)
    train_split, val_split, (x_test, y_test) = digits_splits(channels_first=True)
    model = CNN(jax.random.PRNGKey(0))
    state = train(model, args, train_split, val_split)
    module = trained_module(model, state)
    predicted = np.asarray(jax.vmap(module)(x_test)).argmax(axis=-1)
    summary = f"last validation accuracy {state.metrics['validation_accuracy']:.4f}"
    return report(state, predicted, y_test, summary)


if __name__ == "__main__":
    main()
