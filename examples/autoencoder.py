"""A custom training step with `fl.loop`: an autoencoder that compresses 8x8 digits to 8 numbers.

`fl.loop(step_fn, init_fn)` runs any pure step `step_fn(batch, step_state) -> step_state`.
The step state is a dict; the loop's metrics read its conventional keys: `"loss"` (a scalar)
and `"y_pred"`, compared with the batch's second element `y` (here the image itself). The
example validates on held-out images, stops early, saves the State half-way and resumes
from it, and compares the reconstruction error with PCA's (the best linear code of the same
size).

    python examples/autoencoder.py             # the full run
    python examples/autoencoder.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import argparse
import tempfile

import flax.linen as nn
import jax
import numpy as np
import optax
from _args import at_least
from sklearn.datasets import load_digits

import fuseloop as fl

CODE_SIZE = 8


class AutoEncoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        code = nn.Dense(CODE_SIZE)(nn.relu(nn.Dense(32)(x)))
        return nn.sigmoid(nn.Dense(64)(nn.relu(nn.Dense(32)(code))))


MODEL = AutoEncoder()
OPTIMIZER = optax.adam(3e-3)


def init_fn(first_batch, seed):
    """The first step state, built from the first batch's shapes (`init_state` is a seed)."""
    x, _ = first_batch
    params = MODEL.init(jax.random.PRNGKey(seed), x)
    reconstruction = MODEL.apply(params, x)
    return {
        "params": params,
        "opt_state": OPTIMIZER.init(params),
        "loss": np.float32(0.0),
        "y_pred": reconstruction,
    }


def step_fn(batch, state):
    """One optimizer step on the mean squared reconstruction error."""
    x, _ = batch

    def loss_of(params):
        reconstruction = MODEL.apply(params, x)
        return ((reconstruction - x) ** 2).mean(), reconstruction

    (loss, reconstruction), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"])
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    return {
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
        "loss": loss,
        "y_pred": reconstruction,
    }


def pca_error(x_train, x_test, components):
    """Mean squared error of the best linear code of the same size (fit on train)."""
    mean = x_train.mean(axis=0)
    _, _, vt = np.linalg.svd(x_train - mean, full_matrices=False)
    basis = vt[:components]
    reconstruction = (x_test - mean) @ basis.T @ basis + mean
    return float(((reconstruction - x_test) ** 2).mean())


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=at_least(1), default=60)
    parser.add_argument("--quick", action="store_true", help="2 epochs of 4 iterations")
    parser.add_argument("--fuse", type=at_least(0), default=16, help="chunk size (0: unfused)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    x = (load_digits().data / 16.0).astype(np.float32)
    x = x[np.random.default_rng(0).permutation(len(x))]
    x_train, x_val, x_test = x[:1200], x[1200:1500], x[1500:]
    train = fl.data.arrays(x_train, x_train, batch_size=32, seed=0)  # y is the image itself
    val = fl.data.arrays(x_val, x_val, batch_size=100, shuffle=False)
    loop = (
        fl.loop(step_fn, init_fn)
        .metric("loss")  # reads step_state["loss"]
        .metric("mean_absolute_error")  # reads step_state["y_pred"] against the batch's y
        .validate(MODEL, val)  # evaluates MODEL on state.params
        .early_stop("validation_mean_absolute_error", patience=5)
    )
    epochs, iterations = (2, 4) if args.quick else (args.epochs, None)
    fuse = args.fuse or False
    # Train half of the epochs, save, and resume from the file: a resumed run continues
    # the epochs, the optimizer state, the history and the early-stopping patience.
    first = loop.run(train, 0, epochs=max(1, epochs // 2), iterations=iterations, fuse=fuse)
    with tempfile.TemporaryDirectory() as folder:
        fl.save_state(first, f"{folder}/half")
        state = loop.run(
            train, fl.load_state(f"{folder}/half"), epochs=epochs, iterations=iterations, fuse=fuse
        )
    reconstruction = np.asarray(MODEL.apply(state.params, x_test))
    error = float(((reconstruction - x_test) ** 2).mean())
    baseline = pca_error(x_train, x_test, CODE_SIZE)
    print(
        f"{state.status} after {len(state.history)} epochs (resumed at epoch "
        f"{len(first.history) + 1})"
    )
    print(
        f"test reconstruction MSE with an {CODE_SIZE}-number code: {error:.5f} "
        f"(PCA with {CODE_SIZE} components: {baseline:.5f})"
    )
    return {"state": state, "first": first, "test_mse": error, "pca_mse": baseline}


if __name__ == "__main__":
    main()
