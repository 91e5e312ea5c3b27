"""The digits CNN written with flax.nnx: a module that owns its parameters and state.

fuseloop splits the nnx module into its parameters and the rest of its state (dropout RNG
streams, batch statistics), trains them as plain arrays, and switches the module between
`.train()` and `.eval()` for training and evaluation steps.

    python examples/nnx_cnn_digits.py             # the full run
    python examples/nnx_cnn_digits.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import numpy as np
from _digits import digits_splits, parse, report, train
from flax import nnx

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


def main(argv=None) -> dict:
    args = parse(__doc__, argv)
    train_split, val_split, (x_test, y_test) = digits_splits()
    model = CNN(nnx.Rngs(params=0, dropout=1))
    state = train(model, args, train_split, val_split)
    module = trained_module(model, state)
    predicted = np.asarray(module(x_test)).argmax(axis=-1)
    summary = f"last validation accuracy {state.metrics['validation_accuracy']:.4f}"
    return report(state, predicted, y_test, summary)


if __name__ == "__main__":
    main()
