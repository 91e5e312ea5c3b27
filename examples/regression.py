"""Regression on scikit-learn's diabetes data: an MLP against ordinary least squares.

442 patients, 10 standardized measurements, and a disease-progression score one year later.
The example standardizes features and target on the training split only, trains with the
mean squared error, watches the validation MAE, lowers the learning rate when it stalls,
stops early, and compares test R^2 and MAE with a linear least-squares fit (on data this
small and this close to linear, least squares is hard to beat: the MLP roughly matches it).

    python examples/regression.py             # the full run
    python examples/regression.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import argparse

import numpy as np
from _args import at_least
from sklearn.datasets import load_diabetes

import fuseloop as fl


def splits(seed: int = 0):
    """(x, y) for train/val/test (60/20/20), standardized with the training statistics."""
    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order].astype(np.float32), y[order].astype(np.float32)[:, None]
    a, b = int(0.6 * len(x)), int(0.8 * len(x))
    x_mean, x_std = x[:a].mean(0), x[:a].std(0)
    y_mean, y_std = y[:a].mean(), y[:a].std()
    scale = lambda xs, ys: ((xs - x_mean) / x_std, (ys - y_mean) / y_std)  # noqa: E731
    return scale(x[:a], y[:a]), scale(x[a:b], y[a:b]), scale(x[b:], y[b:]), float(y_std)


def predict(model, state, x):
    if hasattr(fl, "predict"):
        return np.asarray(fl.predict(model, state, x))
    # fuseloop releases without fl.predict: apply the trained variables directly.
    return np.asarray(model.apply(state.params, x))


def r2(y, y_hat) -> float:
    return float(1 - ((y - y_hat) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=at_least(1), default=200)
    parser.add_argument("--quick", action="store_true", help="2 epochs of 4 iterations")
    parser.add_argument("--fuse", type=at_least(0), default=8, help="chunk size (0: unfused)")
    parser.add_argument("--progress", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    (x_train, y_train), (x_val, y_val), (x_test, y_test), y_std = splits()
    train = fl.data.arrays(x_train, y_train, batch_size=16, seed=0)
    val = fl.data.arrays(x_val, y_val, batch_size=len(x_val), shuffle=False)
    model = fl.models.mlp([32, 32, 1])
    loop = (
        fl.trainer(model, "mean_squared_error", "adamw")
        .metric("mean_absolute_error")
        .validate(model, val)
        .reduce_lr_on_plateau("validation_loss", factor=0.5, patience=5)
        .early_stop("validation_loss", patience=15)
    )
    epochs, iterations = (2, 4) if args.quick else (args.epochs, None)
    state = loop.run(
        train, epochs=epochs, iterations=iterations, fuse=args.fuse or False, progress=args.progress
    )
    y_hat = predict(model, state, x_test)
    design = np.hstack([x_train, np.ones((len(x_train), 1), np.float32)])
    coefficients, *_ = np.linalg.lstsq(design, y_train, rcond=None)
    y_linear = np.hstack([x_test, np.ones((len(x_test), 1), np.float32)]) @ coefficients
    result = {
        "mlp_r2": r2(y_test, y_hat),
        "linear_r2": r2(y_test, y_linear),
        "mlp_mae": float(np.abs(y_test - y_hat).mean() * y_std),
        "linear_mae": float(np.abs(y_test - y_linear).mean() * y_std),
    }
    print(f"{state.status} after {len(state.history)} epochs")
    print(
        f"test R^2: MLP {result['mlp_r2']:.3f}, least squares {result['linear_r2']:.3f}; "
        f"test MAE in score points: MLP {result['mlp_mae']:.1f}, "
        f"least squares {result['linear_mae']:.1f}"
    )
    return {"state": state, **result}


if __name__ == "__main__":
    main()
