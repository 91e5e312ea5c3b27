"""Convolutions inside fuseloop's programs lower channel-last on CPU (docs/design.md §10):
the same values as JAX's own lowering of a standalone program, fuseloop's programs only."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import fuseloop as fl
from conftest import assert_tree_equal
from fuseloop._step import init_tail
from fuseloop.engine import conv_layout
from fuseloop.engine.programs import Programs

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the channel-last lowering is CPU-only"
)

CHANNEL_LAST_2D = "b01f_01io->b01f"


class TinyCNN(nn.Module):
    """Conv + ReLU + Conv + mean pool + Dense, channel-last as flax writes it."""

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = nn.relu(nn.Conv(6, (3, 3), strides=(2, 2))(x))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


CNN_TX = optax.sgd(0.1)


@functools.cache
def _cnn_loop() -> Any:
    """The two flax CNN tests' trainer: one Loop, so its programs are traced and compiled once
    (neither test's claim depends on the optimizer)."""
    return fl.trainer(TinyCNN(), "sparse_categorical_cross_entropy", CNN_TX)


def _images(n_batches: int = 6, batch: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n_batches, batch, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 3, size=(n_batches, batch)).astype(np.int32)
    return list(zip(x, y, strict=True))


def _conv_labels(hlo_text: str) -> set[str]:
    return {
        line.split("dim_labels=")[1].split(",")[0]
        for line in hlo_text.splitlines()
        if " convolution(" in line
    }


def _kernel_gradient_loop(x: Any, w: Any, trips: Any) -> Any:
    """A loop whose body takes a convolution's kernel gradient (batch and feature swapped)."""

    def loss(w: Any) -> Any:
        numbers = ("NHWC", "HWIO", "NHWC")
        out = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=numbers)
        return (out**2).sum()

    return lax.fori_loop(0, trips, lambda _, w: w - 0.01 * jax.grad(loss)(w), w)


def test_only_fuseloop_programs_get_the_channel_last_form():
    # Host arrays: an eager jnp.ones would compile programs of its own.
    x, w = np.ones((2, 5, 5, 3), np.float32), np.ones((3, 3, 3, 4), np.float32)
    ours = jax.jit(conv_layout.named(lambda x, w, n: _kernel_gradient_loop(x, w, n), "probe"))
    theirs = jax.jit(lambda x, w, n: _kernel_gradient_loop(x, w, n))
    assert _conv_labels(ours.lower(x, w, 1).compile().as_text()) == {CHANNEL_LAST_2D}
    # A program of the user's keeps the form JAX gives it inside a loop.
    assert _conv_labels(theirs.lower(x, w, 1).compile().as_text()) != {CHANNEL_LAST_2D}
    np.testing.assert_allclose(ours(x, w, 2), theirs(x, w, 2), rtol=1e-6)


def test_a_cnn_runs_every_convolution_channel_last_and_fused_equals_unfused():
    loop = _cnn_loop()
    unfused = loop.run(_images(), epochs=2)
    fused = loop.run(_images(), epochs=2, fuse=4)
    assert_tree_equal(fused.step_state, unfused.step_state, "fused vs unfused step state")
    assert fused.history == unfused.history
    x, y = _images()[0]
    chunk = tuple(jax.ShapeDtypeStruct((4, *a.shape), a.dtype) for a in (x, y))
    tail = init_tail(loop.metrics, loop.guard_nonfinite)
    for program, batch in ((Programs(loop).unfused(), (x, y)), (Programs(loop).chunk(), chunk)):
        text = program.lower(fused.step_state, tail, batch, np.int32(1)).compile().as_text()
        assert _conv_labels(text) == {CHANNEL_LAST_2D}


def test_a_cnn_trains_like_a_hand_written_jitted_step():
    loop = _cnn_loop()
    model, tx = TinyCNN(), CNN_TX
    # The two runs' shared starting point, drawn on the host in the shapes model.init gives
    # (model.init itself compiles a program, eagerly one per op).
    shapes = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(1), x), _images()[0][0])
    rng = np.random.default_rng(1)
    variables = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(s.dtype), shapes)
    state = loop.run(_images(), variables, fuse=4)

    @jax.jit
    def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        def loss_fn(p: Any) -> Any:
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = variables["params"], tx.init(variables["params"])
    for x, y in _images():
        params, opt_state = step(params, opt_state, x, y)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        state.params["params"],
        params,
    )


LAYOUTS = {
    # name: (dimension numbers, lhs shape, rhs shape, extra arguments)
    "nchw": (("NCHW", "OIHW", "NCHW"), (2, 4, 7, 6), (6, 4, 3, 2), {}),
    "nhwc-strided-padded": (
        ("NHWC", "HWIO", "NHWC"),
        (2, 7, 6, 4),
        (3, 2, 4, 6),
        {"window_strides": (2, 1), "padding": ((1, 0), (2, 1))},
    ),
    "ncw-dilated-kernel": (("NCW", "OIW", "NCW"), (3, 4, 9), (5, 4, 3), {"rhs_dilation": (2,)}),
    "nwc-dilated-input": (
        ("NWC", "WIO", "NWC"),
        (3, 9, 4),
        (3, 4, 5),
        {"lhs_dilation": (2,), "padding": ((1, 1),)},
    ),
    "ncdhw": (("NCDHW", "OIDHW", "NCDHW"), (2, 2, 5, 4, 3), (3, 2, 2, 2, 2), {}),
    "grouped": (("NHWC", "HWIO", "NHWC"), (2, 6, 6, 4), (3, 3, 2, 6), {"feature_group_count": 2}),
    "depthwise-nchw": (
        ("NCHW", "OIHW", "NCHW"),
        (2, 4, 6, 6),
        (4, 1, 3, 3),
        {"feature_group_count": 4},
    ),
    "cnhw-mixed": (("CNHW", "IOHW", "HWNC"), (3, 2, 6, 5), (3, 4, 2, 2), {}),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_rewrite_computes_the_same_convolution_and_gradients(layout, dtype):
    """Inside a fuseloop program (rewritten) against a standalone program (JAX's own)."""
    numbers, lhs_shape, rhs_shape, extra = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    # Cast on the host: an eager device cast compiles a program per shape and dtype.
    lhs = rng.normal(size=lhs_shape).astype(dtype)
    rhs = rng.normal(size=rhs_shape).astype(dtype)
    spatial = len(lhs_shape) - 2
    arguments = {"window_strides": (1,) * spatial, "padding": "SAME", **extra}

    def values(lhs: Any, rhs: Any) -> Any:
        def conv(lhs: Any, rhs: Any) -> Any:
            return lax.conv_general_dilated(lhs, rhs, dimension_numbers=numbers, **arguments)

        loss = lambda a, b: (conv(a, b).astype(jnp.float32) ** 2).sum()  # noqa: E731
        return (conv(lhs, rhs), *jax.grad(loss, argnums=(0, 1))(lhs, rhs))

    def looped(lhs: Any, rhs: Any, trips: Any) -> Any:
        return lax.fori_loop(0, trips, lambda _, __: values(lhs, rhs), values(lhs, rhs))

    expected = jax.jit(values)(lhs, rhs)
    ours = jax.jit(conv_layout.named(looped, "layout_probe"))(lhs, rhs, 1)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, want, got in zip(("output", "lhs grad", "rhs grad"), expected, ours, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(want, np.float32),
            rtol=tolerance,
            atol=tolerance,
            err_msg=name,
        )


def test_an_equinox_channel_first_cnn_fuses_identically_and_predicts():
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        conv: Any
        head: Any

        def __init__(self) -> None:
            keys = jax.random.split(jax.random.PRNGKey(0), 2)
            self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=keys[0])
            self.head = eqx.nn.Linear(4, 3, key=keys[1])

        def __call__(self, x: Any) -> Any:  # one example, channel-first (1, 6, 6)
            return self.head(jax.nn.relu(self.conv(x)).mean(axis=(1, 2)))

    # Built once, its weights drawn on the host (equinox's initialisers compile a program).
    rng = np.random.default_rng(0)
    net = jax.tree.map(
        lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), eqx.filter_eval_shape(Net)
    )
    data = [(x.transpose(0, 3, 1, 2), y) for x, y in _images()]
    loop = fl.trainer(net, "sparse_categorical_cross_entropy", optax.adam(1e-2))
    unfused = loop.run(data, epochs=2)
    fused = loop.run(data, epochs=2, fuse=4)
    assert_tree_equal(fused.step_state, unfused.step_state, "fused vs unfused step state")
    predicted = fl.predict(net, fused, data[0][0])
    trained = fl.models.trained(net, fused)
    np.testing.assert_allclose(
        predicted, jax.jit(jax.vmap(trained))(data[0][0]), rtol=1e-5, atol=1e-6
    )
