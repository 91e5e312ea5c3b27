"""Two networks in one step with `fl.loop`: a GAN learning a ring of eight Gaussians.

Each step updates the discriminator on real and generated points, then the generator
against the updated discriminator: two models and two optimizers in one pure step, fused
like any other. The noise comes from `jax.random.fold_in(key, step)`, a counter in the step
state, so a fused and an unfused run draw the same numbers. The result is judged by mode
coverage: how many of the eight Gaussians the generated points land on.

    python examples/two_networks_gan.py             # the full run
    python examples/two_networks_gan.py --quick     # a smoke test: 2 short epochs
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _args import at_least

import fuseloop as fl
from fuseloop.handlers.log import format_metrics

NOISE, MODES, SPREAD = 8, 8, 0.05
CENTERS = np.stack(
    [np.cos(np.arange(MODES) * 2 * np.pi / MODES), np.sin(np.arange(MODES) * 2 * np.pi / MODES)],
    axis=1,
).astype(np.float32)


class MLP(nn.Module):
    outputs: int

    @nn.compact
    def __call__(self, x):
        for width in (64, 64):
            x = nn.leaky_relu(nn.Dense(width)(x), 0.2)
        return nn.Dense(self.outputs)(x)


GENERATOR, DISCRIMINATOR = MLP(2), MLP(1)
G_OPT, D_OPT = optax.adam(1e-3, b1=0.5), optax.adam(1e-3, b1=0.5)


def ring(n: int, seed: int):
    """n points on the ring's eight Gaussians, and the index of each point's Gaussian."""
    rng = np.random.default_rng(seed)
    mode = rng.integers(0, MODES, n)
    points = CENTERS[mode] + SPREAD * rng.normal(size=(n, 2))
    return points.astype(np.float32), mode.astype(np.int32)


def init_fn(first_batch, seed):
    real, _ = first_batch
    key_g, key_d, key_noise = jax.random.split(jax.random.PRNGKey(seed), 3)
    g = GENERATOR.init(key_g, jnp.zeros((1, NOISE)))
    d = DISCRIMINATOR.init(key_d, real)
    return {
        "g": g,
        "d": d,
        "g_opt": G_OPT.init(g),
        "d_opt": D_OPT.init(d),
        "key": key_noise,
        "step": jnp.zeros((), jnp.int32),
        "d_loss": jnp.zeros(()),
        "g_loss": jnp.zeros(()),
    }


def _bce(logits, label):
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label)).mean()


def step_fn(batch, s):
    real, _ = batch
    noise = jax.random.normal(jax.random.fold_in(s["key"], s["step"]), (real.shape[0], NOISE))

    def d_loss_of(d):
        fake = GENERATOR.apply(s["g"], noise)
        return _bce(DISCRIMINATOR.apply(d, real), 1.0) + _bce(DISCRIMINATOR.apply(d, fake), 0.0)

    d_loss, d_grads = jax.value_and_grad(d_loss_of)(s["d"])
    d_updates, d_opt = D_OPT.update(d_grads, s["d_opt"], s["d"])
    d = optax.apply_updates(s["d"], d_updates)

    def g_loss_of(g):  # the non-saturating generator loss
        return _bce(DISCRIMINATOR.apply(d, GENERATOR.apply(g, noise)), 1.0)

    g_loss, g_grads = jax.value_and_grad(g_loss_of)(s["g"])
    g_updates, g_opt = G_OPT.update(g_grads, s["g_opt"], s["g"])
    return {
        "g": optax.apply_updates(s["g"], g_updates),
        "d": d,
        "g_opt": g_opt,
        "d_opt": d_opt,
        "key": s["key"],
        "step": s["step"] + 1,
        "d_loss": d_loss,
        "g_loss": g_loss,
    }


def coverage(samples: np.ndarray) -> tuple[int, float]:
    """Gaussians hit by at least 1% of the samples, and the share of samples within
    four standard deviations of some Gaussian's center."""
    distance = np.linalg.norm(samples[:, None, :] - CENTERS[None], axis=-1)
    nearest, close = distance.argmin(axis=1), distance.min(axis=1) < 4 * SPREAD
    hits = np.bincount(nearest[close], minlength=MODES)
    return int((hits >= 0.01 * len(samples)).sum()), float(close.mean())


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=at_least(1), default=40)
    parser.add_argument("--quick", action="store_true", help="2 epochs of 4 iterations")
    parser.add_argument("--fuse", type=at_least(0), default=50, help="chunk size (0: unfused)")
    parser.add_argument("--log", type=at_least(0), default=0, help="a log line every N epochs")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    points, mode = ring(12_800, seed=0)
    data = fl.data.arrays(points, mode, batch_size=128, seed=0)
    loop = fl.loop(step_fn, init_fn).metric("d_loss").metric("g_loss")
    if args.log:
        loop = loop.log(
            lambda s: f"Epoch {s.epoch + 1}/{s.max_epoch} - {format_metrics(s.metrics)}\n",
            event="epoch_completed",
            filter={"every": args.log},
        )
    epochs, iterations = (2, 4) if args.quick else (args.epochs, None)
    state = loop.run(data, 0, epochs=epochs, iterations=iterations, fuse=args.fuse or False)
    noise = jax.random.normal(jax.random.PRNGKey(1), (2000, NOISE))
    samples = np.asarray(GENERATOR.apply(state.step_state["g"], noise))
    modes, share = coverage(samples)
    print(
        f"after {len(state.history)} epochs: discriminator loss "
        f"{state.metrics['d_loss']:.3f}, generator loss {state.metrics['g_loss']:.3f}"
    )
    print(
        f"the generator covers {modes} of {MODES} Gaussians; {share:.0%} of its points "
        f"lie within 4 standard deviations of a center"
    )
    return {"state": state, "modes": modes, "share": share, "samples": samples}


if __name__ == "__main__":
    main()
