"""A convolutional network on scikit-learn's 8x8 digits, written with flax.linen.

Conv + BatchNorm + Dropout, a validation split watched by early stopping, and predictions
on a test split the training never saw. The module's `train` argument switches Dropout and
BatchNorm between training and evaluation; fuseloop passes `train=True` (with a dropout
key) in training steps and `train=False` when it validates or predicts.

    python examples/linen_cnn_digits.py             # the full run (about 40 epochs at most)
    python examples/linen_cnn_digits.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import flax.linen as nn
import numpy as np
from _digits import digits_splits, parse, report, train

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


def predict_logits(model, state, x):
    """The model's eval-mode outputs for every row of x."""
    if hasattr(fl, "predict"):
        return np.asarray(fl.predict(model, state, x, batch_size=256))
    # fuseloop releases without fl.predict: apply the trained variables directly.
    return np.asarray(model.apply(state.params, x, train=False))


def main(argv=None) -> dict:
    args = parse(__doc__, argv)
    train_split, val_split, (x_test, y_test) = digits_splits()
    model = CNN()
    state = train(model, args, train_split, val_split)
    best = min(state.history, key=lambda e: state.history[e]["validation_loss"])
    predicted = predict_logits(model, state, x_test).argmax(axis=-1)
    summary = (
        f"best validation loss {state.history[best]['validation_loss']:.4f} at epoch {best + 1}"
    )
    return report(state, predicted, y_test, summary)


if __name__ == "__main__":
    main()
