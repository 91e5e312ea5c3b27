"""`fl.trainer`: training, losses, optimizers, seeds and RNG, BatchNorm/dropout models,
model adapters, logging, `jit=False`, and the unfused loop's dispatch-level stats."""

from __future__ import annotations

import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fuseloop as fl
from conftest import (
    CLASSES,
    FEATURES,
    DropBN,
    DropoutOnly,
    assert_runs_identical,
    assert_tree_close,
    assert_tree_equal,
    counter_init,
    counter_loop,
    make_batches,
    tiny_mlp,
    trainer,
)

DATA = make_batches(12)

# Loops shared by several tests: a Loop caches its compiled programs, so reusing one keeps
# the suite fast (and a second run of a loop must not recompile anyway).
MLP_LOOP = trainer(optimizer=optax.adam(0.05)).metric("accuracy")
DROPBN_LOOP = trainer(DropBN(), optax.adam(0.05), seed=3).metric("accuracy")


def _host_variables(model, x, seed=0):
    """Variables in the shapes `model.init` gives, drawn on the host (an eager init compiles
    a program per op), for tests that only need a starting point."""
    shapes = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x), x)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)


def learns(state: fl.State) -> bool:
    losses = [state.history[e]["loss"] for e in sorted(state.history)]
    return losses[-1] < losses[0] and all(np.isfinite(losses))


# --------------------------------------------------------------------------- training
def test_trainer_learns_and_returns_usable_params():
    model = tiny_mlp()
    state = MLP_LOOP.run(DATA, epochs=3)
    assert learns(state)
    assert state.history[2]["accuracy"] > state.history[0]["accuracy"]
    assert set(state.params) == {"params"}
    # Traced, not run: only the shape is checked (run eagerly, each op compiles its own).
    logits = jax.eval_shape(model.apply, state.params, DATA[0][0])
    assert logits.shape == (4, CLASSES)
    assert int(state.step_state["step"]) == 36
    assert state.status == "completed"


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_named_optimizers(name):
    state = trainer(optimizer=name).run(DATA[:2], epochs=2)
    assert set(state.params) == {"params"}
    assert np.isfinite(state.metrics["loss"])
    # Named optimizers expose their learning rate in the optimizer state.
    assert "learning_rate" in state.step_state["opt_state"].hyperparams


def test_any_optax_transformation_and_its_state_structure():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    state = trainer(optimizer=tx).run(DATA[:4])
    expected = jax.eval_shape(tx.init, state.params["params"])  # its structure, not run
    assert jax.tree.structure(state.step_state["opt_state"]) == jax.tree.structure(expected)


def _loss_case(name):
    rng = np.random.default_rng(2)
    x = [rng.normal(size=(4, FEATURES)).astype(np.float32) for _ in range(3)]
    if name in ("mean_squared_error", "mean_absolute_error"):
        ys = [rng.normal(size=(4, 2)).astype(np.float32) for _ in x]
        out = 2
    elif name == "binary_cross_entropy":
        ys = [rng.integers(0, 2, size=(4, 1)).astype(np.float32) for _ in x]
        out = 1
    elif name == "categorical_cross_entropy":
        ys = [np.eye(3, dtype=np.float32)[rng.integers(0, 3, size=4)] for _ in x]
        out = 3
    else:
        ys = [rng.integers(0, 3, size=(4,)).astype(np.int32) for _ in x]
        out = 3
    return list(zip(x, ys, strict=True)), out


def _hand_loss(name, y, logits):
    if name == "mean_squared_error":
        return np.mean((logits - y) ** 2)
    if name == "mean_absolute_error":
        return np.mean(np.abs(logits - y))
    if name == "binary_cross_entropy":
        p = 1 / (1 + np.exp(-logits))
        return np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p)))
    log_softmax = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
    if name == "categorical_cross_entropy":
        return np.mean(-np.sum(y * log_softmax, -1))
    return np.mean(-log_softmax[np.arange(len(y)), y])


@pytest.mark.parametrize(
    "name",
    [
        "mean_squared_error",
        "mean_absolute_error",
        "binary_cross_entropy",
        "categorical_cross_entropy",
        "sparse_categorical_cross_entropy",
    ],
)
def test_named_losses_take_logits_and_match_a_hand_computation(name):
    data, out = _loss_case(name)
    model = fl.models.mlp([4, out])
    variables = _host_variables(model, data[0][0])
    first: list = []
    loop = fl.trainer(model, name, "sgd").handle_event(
        "iteration_completed", lambda s: first.append(s.metrics["loss"]), "first"
    )
    loop.run(data, variables)
    logits = np.asarray(jax.jit(model.apply)(variables, data[0][0]), np.float64)
    y = data[0][1]
    expected = _hand_loss(name, y if y.dtype == np.int32 else y.astype(np.float64), logits)
    assert first[0] == pytest.approx(expected, rel=1e-5)


def test_callable_loss():
    def my_loss(y_true, y_pred):
        return optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true).mean()

    by_name = MLP_LOOP.run(DATA[:4], epochs=2)
    by_callable = (
        fl.trainer(tiny_mlp(), my_loss, optax.adam(0.05)).metric("accuracy").run(DATA[:4], epochs=2)
    )
    assert_tree_close(by_name.params, by_callable.params)


def test_user_arrays_are_never_invalidated_by_donation():
    # The user's device arrays (drawn on the host: an eager init compiles each op).
    variables = jax.device_put(_host_variables(tiny_mlp(), DATA[0][0], seed=4))
    before = jax.tree.map(np.array, variables)
    data = [(jnp.asarray(x), jnp.asarray(y)) for x, y in DATA[:4]]
    state = MLP_LOOP.run(data, variables, epochs=2)
    assert_tree_equal(variables, before)  # raises if a buffer was deleted
    for (x, y), (x0, y0) in zip(data, DATA[:4], strict=True):
        assert np.array_equal(x, x0) and np.array_equal(y, y0)
    # The returned State is not donated either: a later run does not invalidate it.
    kept = jax.tree.map(np.array, state.params)
    MLP_LOOP.run(DATA[:4], state.params)
    assert_tree_equal(state.params, kept)


# --------------------------------------------------------------------------- seeds and RNG
def test_same_seed_is_bitwise_reproducible_and_seeds_differ():
    a = DROPBN_LOOP.run(DATA[:4], epochs=2)
    b = DROPBN_LOOP.run(DATA[:4], epochs=2)
    d = trainer(DropBN(), optax.adam(0.05), seed=4).metric("accuracy").run(DATA[:4], epochs=2)
    assert_runs_identical(a, b)
    assert not np.array_equal(
        a.params["params"]["Dense_0"]["kernel"], d.params["params"]["Dense_0"]["kernel"]
    )


def test_dropout_masks_come_from_the_global_step_not_the_epoch_iteration():
    # A zero learning rate keeps params fixed: epochs over identical data differ only
    # through the dropout masks, which must not repeat each epoch.
    loop = trainer(DropoutOnly(), optax.sgd(0.0))
    state = loop.run(DATA[:3], epochs=2)
    assert state.history[0]["loss"] != state.history[1]["loss"]
    assert int(state.step_state["step"]) == 6


def test_resumed_run_continues_the_rng_and_matches_an_uninterrupted_run():
    full = DROPBN_LOOP.run(DATA[:4], epochs=3)
    first = DROPBN_LOOP.run(DATA[:4], epochs=1)
    resumed = DROPBN_LOOP.run(DATA[:4], first, epochs=3)
    assert_tree_equal(resumed.step_state, full.step_state)
    assert resumed.history == full.history


# --------------------------------------------------------------------------- BatchNorm
def test_batchnorm_and_dropout_model_trains_and_updates_batch_stats():
    model = DropBN()
    # BatchNorm starts at 0 / 1 (jitted, its only output the statistics: one small program).
    initial = jax.jit(lambda x: model.init(jax.random.PRNGKey(0), x)["batch_stats"])(DATA[0][0])
    state = DROPBN_LOOP.run(DATA, epochs=3)
    assert set(state.params) == {"params", "batch_stats"}
    stats = state.params["batch_stats"]["BatchNorm_0"]
    assert not np.allclose(stats["mean"], initial["BatchNorm_0"]["mean"])
    assert not np.allclose(stats["var"], initial["BatchNorm_0"]["var"])
    assert learns(state)
    # What the trainer returns is what model.apply accepts.
    y = jax.jit(model.apply)(state.params, DATA[0][0])  # one program, not one per op
    assert y.shape == (4, CLASSES) and np.isfinite(np.asarray(y)).all()
    # batch_stats are not optimized: the optimizer state only covers "params".
    opt_leaves = jax.tree.leaves(state.step_state["opt_state"])
    n_params = len(jax.tree.leaves(state.params["params"]))
    assert len(opt_leaves) >= n_params
    assert jax.tree.structure(state.step_state["opt_state"]) == jax.tree.structure(
        jax.eval_shape(optax.adam(0.05).init, state.params["params"])
    )


# --------------------------------------------------------------------------- adapters
class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class NnxDropBN(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def _pair():
    def init(rng, x):
        k1, k2 = jax.random.split(rng)
        return {
            "w1": jax.random.normal(k1, (x.shape[1], 8)) * 0.5,
            "b1": jnp.zeros(8),
            "w2": jax.random.normal(k2, (8, CLASSES)) * 0.5,
            "b2": jnp.zeros(CLASSES),
        }

    def apply(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    return init, apply


def _haiku_order_pair():
    """haiku's transformed order, `apply(params, rng, x)`, with dropout from that key."""
    init, plain_apply = _pair()

    def apply(p, rng, x):
        if rng is not None:
            x = x * jax.random.bernoulli(rng, 0.8, x.shape) / 0.8
        return plain_apply(p, x)

    return init, apply


# The equinox MLP built in one jitted program (built eagerly, each initialiser op compiles).
_EQX_MLP = eqx.filter_jit(lambda: eqx.nn.MLP(FEATURES, CLASSES, 8, 1, key=jax.random.PRNGKey(0)))

ADAPTERS = {
    "mlp_tanh": lambda: fl.models.mlp([8, CLASSES], activation="tanh"),
    "nnx": lambda: fl.models.from_nnx(NnxMLP(nnx.Rngs(0))),
    "nnx_dropout_batchnorm": lambda: fl.models.from_nnx(NnxDropBN(nnx.Rngs(0))),
    "equinox": lambda: fl.models.from_equinox(_EQX_MLP()),
    "pair": _pair,  # a bare (init_fn, apply_fn) tuple
    "haiku_order_pair": _haiku_order_pair,
}


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_model_adapters_train_fuse_identically_and_apply(kind):
    loop = trainer(ADAPTERS[kind](), optax.adam(0.05)).metric("accuracy")
    unfused = loop.run(DATA, epochs=3)
    fused = loop.run(DATA, epochs=3, fuse=5)
    assert learns(unfused)
    assert_runs_identical(unfused, fused)
    adapter = fl.models.as_model(ADAPTERS[kind]())
    # Traced, not run: only the shape is checked (run eagerly, each op compiles its own).
    y = jax.eval_shape(adapter.apply, unfused.params, DATA[0][0])
    assert np.shape(y) == (4, CLASSES)


def test_a_haiku_order_apply_gets_the_key_second_and_none_outside_training():
    seen = []
    model = fl.models.from_functions(lambda rng, x: 1.0, lambda p, rng, x: seen.append(rng))
    model.forward(1.0, "x", train=True, rng="key")
    model.apply(1.0, "x")
    assert seen == ["key", None]


def test_models_are_recognized_without_an_explicit_adapter():
    assert isinstance(fl.models.as_model(NnxMLP(nnx.Rngs(0))), fl.models.from_nnx)
    eqx_mlp = _EQX_MLP()
    assert isinstance(fl.models.as_model(eqx_mlp), fl.models.from_equinox)
    init, apply = _pair()
    assert isinstance(fl.models.as_model((init, apply)), fl.models.from_functions)


# --------------------------------------------------------------------------- jit=False
@pytest.mark.parametrize("model", [tiny_mlp, DropBN], ids=["mlp", "dropout_batchnorm"])
def test_jit_false_matches_jit_true(model):
    # sgd, not adam: a Dense bias feeding BatchNorm has a (numerically) zero gradient, which
    # adam would normalize into full steps of arbitrary sign, amplifying rounding noise.
    loop = trainer(model(), optax.sgd(0.1)).metric("accuracy")
    compiled = loop.run(DATA[:3], epochs=2)
    eager = loop.run(DATA[:3], epochs=2, jit=False)
    assert_tree_close(compiled.step_state, eager.step_state, rtol=1e-5, atol=1e-6)
    for epoch in range(2):
        for name, value in compiled.history[epoch].items():
            assert eager.history[epoch][name] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert eager.event_counts == compiled.event_counts


# --------------------------------------------------------------------------- logging
# "adam" is a named optimizer, so its learning rate is tracked and logged too.
RATE = r" - learning_rate: (\d\.\d{7})"
LINE = re.compile(
    rf"^Epoch (\d+)/2 - iteration (\d+) - loss: (\d+\.\d{{7}}){RATE} - accuracy: (\d\.\d{{7}})$"
)
SUMMARY = re.compile(rf"^Epoch (\d+)/2 - loss: (\d+\.\d{{7}}){RATE} - accuracy: (\d\.\d{{7}})$")


def test_log_lines_every_n_iterations_and_one_per_epoch():
    out = io.StringIO()
    loop = fl.trainer(
        tiny_mlp(), "sparse_categorical_cross_entropy", "adam", log=5, log_stream=out
    ).metric("accuracy")
    state = loop.run(DATA, epochs=2)
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    parsed = [LINE.match(line) for line in lines if " - iteration " in line]
    assert all(parsed), lines
    # every=5 on the run's iteration count: counts 1, 6, 11, 16, 21; shown 1-based.
    assert [(int(m[1]), int(m[2])) for m in parsed] == [(1, 1), (1, 6), (1, 11), (2, 4), (2, 9)]
    summaries = [SUMMARY.match(line) for line in lines if " - iteration " not in line]
    assert all(summaries), lines
    assert [int(m[1]) for m in summaries] == [1, 2]
    for m, epoch in zip(summaries, (0, 1), strict=True):
        assert m[2] == f"{state.history[epoch]['loss']:.7f}"
    assert state.history[1]["loss"] > 0


def test_log_zero_is_silent(capsys):
    MLP_LOOP.run(DATA[:2])
    assert capsys.readouterr().out == ""


def test_loop_log_writes_fn_output():
    out = io.StringIO()
    counter_loop().log(lambda s: f"[{s.epoch}]", event="epoch_completed", stream=out).run(
        DATA[:2], counter_init(), epochs=3
    )
    assert out.getvalue() == "[0][1][2]"


# --------------------------------------------------------------------------- dispatch level
def test_unfused_stats_count_dispatches_and_host_boundaries():
    loop = MLP_LOOP
    plain = loop.run(DATA, epochs=2)
    assert plain.stats["dispatches"] == 24
    assert plain.stats["h2d_transfers"] == 24
    assert plain.stats["host_syncs"] <= 2  # only the end of each epoch reads metrics
    assert plain.stats["chunk_size"] == 1
    fired: list = []
    watched = loop.handle_event(
        "iteration_completed", lambda s: fired.append(s.metrics), {"every": 4}
    ).run(DATA, epochs=2)
    assert len(fired) == 6
    assert watched.stats["host_syncs"] <= 6 + 2
    assert_tree_equal(watched.step_state, plain.step_state)


@pytest.mark.parametrize("max_in_flight", [1, 3])
def test_max_in_flight_does_not_change_results(max_in_flight):
    assert_runs_identical(
        MLP_LOOP.run(DATA, epochs=2), MLP_LOOP.run(DATA, epochs=2, max_in_flight=max_in_flight)
    )


@pytest.mark.parametrize("device", [False, True])
def test_max_in_flight_makes_the_host_wait_for_queued_unfused_steps(device, monkeypatch):
    """On device-resident data the unfused steps were never throttled."""
    x = np.concatenate([b[0] for b in DATA])
    y = np.concatenate([b[1] for b in DATA])
    data = fl.data.arrays(x, y, batch_size=len(DATA[0][1]), shuffle=False, device=device)
    waits = []
    wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda tree: waits.append(1) or wait(tree))

    def waited(max_in_flight: int) -> int:
        waits.clear()
        MLP_LOOP.run(data, max_in_flight=max_in_flight)
        return len(waits)

    assert waited(1) - waited(1000) >= len(DATA) - 1


@pytest.mark.parametrize(
    "tx",
    [optax.adam(1e-3), optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)],
    ids=["adam", "injected-adam"],
)
def test_a_run_is_bitwise_a_hand_written_jitted_optax_step(tx):
    """The loop a user would write: one jitted step per batch. An injected adam came out an
    ulp apart while XLA lifted work out of fuseloop's step loop (docs/design.md §9)."""
    import flax.linen as nn

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    model = nn.Dense(1)
    start = model.init(jax.random.PRNGKey(0), x[:1])
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]

    @jax.jit
    def step(params, opt_state, xb, yb):
        loss = lambda p: jnp.mean((model.apply(p, xb) - yb) ** 2)  # noqa: E731
        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = start, tx.init(start)
    for _ in range(3):
        for xb, yb in batches:
            params, opt_state = step(params, opt_state, xb, yb)
    loop = fl.trainer(model, "mean_squared_error", tx)
    for fuse in (False, 4):
        state = loop.run(batches, start, epochs=3, fuse=fuse)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
