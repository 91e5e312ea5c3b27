"""`fl.evaluator` and custom `fl.loop` loops."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import (
    DropBN,
    assert_tree_close,
    assert_tree_equal,
    counter_init,
    counter_loop,
    make_batches,
    tiny_mlp,
    trainer,
)

DATA = make_batches(6)


def hand_accuracy(apply, data):
    total = np.float32(0)
    for x, y in data:
        total = np.float32(
            total + np.mean((np.argmax(np.asarray(apply(x)), -1) == y).astype(np.float32))
        )
    return float(total / np.float32(len(data)))


# --------------------------------------------------------------------------- evaluator
def test_evaluator_with_params_and_with_a_state():
    trained = trainer().run(DATA, epochs=2)
    params = jax.tree.map(np.array, trained.params)
    loop = fl.evaluator(tiny_mlp()).metric("accuracy")
    from_params = loop.run(DATA, params)
    from_state = loop.run(DATA, trained)
    expected = hand_accuracy(lambda x: tiny_mlp().apply(params, x), DATA)
    assert from_params.metrics == {"accuracy": expected}
    assert from_state.metrics == {"accuracy": expected}
    # Evaluation leaves the params alone, and the caller's arrays stay valid and unchanged.
    assert_tree_equal(from_params.params, params)
    assert_tree_equal(trained.params, params)
    assert from_params.event_counts["iteration_completed"] == {"total": 6, "epoch": 6}
    assert from_params.status == "completed"


def test_evaluator_runs_flax_modules_in_inference_mode():
    model = DropBN()
    variables = jax.tree.map(np.array, model.init(jax.random.PRNGKey(0), DATA[0][0]))
    # Non-trivial running statistics, so inference mode is distinguishable from training.
    stats = variables["batch_stats"]["BatchNorm_0"]
    stats["mean"] = np.linspace(-1, 1, stats["mean"].size).astype(np.float32)
    stats["var"] = np.linspace(0.5, 3, stats["var"].size).astype(np.float32)
    loop = fl.evaluator(model).metric("accuracy")
    state = loop.run(DATA, variables, epochs=2)
    # train=False: running batch statistics, no dropout, nothing mutated.
    expected = hand_accuracy(lambda x: model.apply(variables, x, train=False), DATA)
    assert state.history[0] == state.history[1] == {"accuracy": expected}
    assert_tree_equal(state.params, variables)


def test_evaluator_needs_params():
    with pytest.raises(ValueError, match="init_state"):
        fl.evaluator(tiny_mlp()).metric("accuracy").run(DATA)


# --------------------------------------------------------------------------- custom loops
def test_custom_loop_without_init_fn():
    init = counter_init()
    state = counter_loop().run(DATA, init, epochs=2)
    assert int(state.step_state["n"]) == 12
    expected = np.float32(0)
    for _ in range(2):
        for x, _ in DATA:
            expected = np.float32(expected + x.sum(dtype=np.float32))
    np.testing.assert_allclose(state.step_state["total"], expected, rtol=1e-5)
    # The caller's initial state is untouched.
    assert int(init["n"]) == 0 and float(init["total"]) == 0.0
    assert state.event_counts["epoch_completed"] == 2


def _regression_data():
    rng = np.random.default_rng(11)
    w = np.array([1.5, -2.0, 0.5], np.float32)
    out = []
    for _ in range(8):
        x = rng.normal(size=(4, 3)).astype(np.float32)
        out.append((x, x @ w))
    return out


def _sgd_step(batch, s):
    x, y = batch

    def loss_fn(w):
        return jnp.mean((x @ w - y) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(s["w"])
    return {"w": s["w"] - 0.1 * grad, "loss": loss, "seen": s["seen"] + x.shape[0]}


def test_custom_loop_with_init_fn_and_a_metric_named_after_a_scalar():
    data = _regression_data()
    calls: list = []

    def init_fn(first_batch, init_state):
        calls.append((np.shape(first_batch[0]), init_state))
        x, _ = first_batch
        return {"w": jnp.zeros(x.shape[1]), "loss": jnp.float32(0), "seen": jnp.int32(0)}

    losses: list = []
    loop = (
        fl.loop(_sgd_step, init_fn)
        .metric("loss")
        .metric("seen", name="examples", accumulate="running_sum")
        .handle_event("iteration_completed", lambda s: losses.append(float(s.step_state["loss"])))
    )
    state = loop.run(data, epochs=3)
    assert calls == [((4, 3), None)]
    for epoch in range(3):
        epoch_losses = losses[epoch * 8 : (epoch + 1) * 8]
        np.testing.assert_allclose(state.history[epoch]["loss"], np.mean(epoch_losses), rtol=1e-5)
    assert state.history[2]["loss"] < state.history[0]["loss"]
    # "seen" at step k is 4*(global step): its running sum over epoch e is exact.
    for epoch in range(3):
        expected = float(sum(4 * (epoch * 8 + i + 1) for i in range(8)))
        assert state.history[epoch]["examples"] == expected


def test_custom_loop_with_predictions_supports_named_metrics():
    def step(batch, s):
        x, y = batch
        return {"y_pred": x, "n": s["n"] + 1}

    data = [(x, y) for x, y in DATA]
    init = {"y_pred": jnp.zeros_like(DATA[0][0]), "n": jnp.int32(0)}
    state = fl.loop(step).metric("accuracy").run(data, init)
    assert state.metrics["accuracy"] == hand_accuracy(lambda x: x, data)


def test_custom_loop_over_non_pair_batches():
    batches = [{"a": np.full((2,), float(i), np.float32)} for i in range(5)]
    loop = fl.loop(lambda b, s: {"sum": s["sum"] + b["a"].sum()}).metric("sum")
    state = loop.run(batches, {"sum": np.float32(0)})
    assert float(state.step_state["sum"]) == 2.0 * sum(range(5))
    # Running average of the running "sum" scalar after each step.
    partial = [2.0 * sum(range(i + 1)) for i in range(5)]
    assert state.metrics["sum"] == pytest.approx(np.mean(partial))


@pytest.mark.parametrize("fuse", [False, True])
def test_a_step_state_leaf_that_changes_shape_is_named_with_the_fix(fuse):
    def step(batch, s):
        x, y = batch
        return {"y_pred": x, "n": s["n"] + 1}

    x = np.concatenate([b[0] for b in DATA])[:14]
    y = np.concatenate([b[1] for b in DATA])[:14]
    ragged = fl.data.arrays(x, y, batch_size=4, shuffle=False, drop_remainder=False, device=True)
    init = {"y_pred": jnp.zeros((4, x.shape[1]), x.dtype), "n": jnp.int32(0)}
    loop = fl.loop(step).metric("accuracy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ragged batch's own warning
        with pytest.raises(ValueError, match=r"\['y_pred'\]: float32\[4, 3\] -> float32\[2, 3\]"):
            loop.run(ragged, init, fuse=fuse)
    with pytest.raises(ValueError, match="drop_remainder=True"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop.run(ragged, init, fuse=fuse)


def _linear_step(batch, s):
    """Builds its step state by name: a key a handler added is dropped, a dtype it changed
    is cast back."""
    x, y = batch
    w = s["w"].astype(jnp.float32)
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y[:, None]) ** 2))(w)
    return {"w": w - 0.1 * grad, "loss": loss}


@pytest.mark.parametrize("fuse", [False, 2, "run"])
@pytest.mark.parametrize(
    ("change", "told"),
    [
        ({"lr": jnp.float32(0.05)}, r"step_state\['lr'\] is gone after one step"),
        ({"w": jnp.zeros((3, 1), jnp.bfloat16)}, r"\['w'\]: bfloat16\[3, 1\] -> float32\[3, 1\]"),
    ],
    ids=["key-added", "dtype-changed"],
)
def test_a_step_state_a_handler_returned_that_the_step_cannot_keep_is_blamed_on_it(
    fuse, change, told
):
    """The step's refusal named a leaf count and blamed the step; it names the key, and a
    note names the handler's event and epoch."""

    def changing(state):
        return "continue", state.replace(step_state={**state.step_state, **change})

    x = np.concatenate([b[0] for b in DATA]).astype(np.float32)
    y = np.concatenate([b[1] for b in DATA]).astype(np.float32)
    data = fl.data.arrays(x, y, batch_size=4, shuffle=False, device=fuse == "run")
    init = {"w": jnp.zeros((3, 1), jnp.float32), "loss": jnp.zeros((), jnp.float32)}
    loop = fl.loop(_linear_step).metric("loss").handle_event("epoch_completed", changing)
    with pytest.raises(ValueError, match=told) as caught:
        loop.run(data, init, epochs=2, fuse=fuse)
    handed = "the step started from the step state a handler of epoch_completed at epoch 0"
    assert any(handed in note for note in caught.value.__notes__), caught.value.__notes__
    assert (
        loop.run(data, init, epochs=1, fuse=fuse).status == "completed"
    )  # its state is never stepped


def test_a_handler_returning_a_state_of_the_same_leaves_is_not_blamed_for_a_ragged_batch():
    """An unfused iteration handler that hands back a step state of the step's own leaves
    at every step; the ragged last batch's refusal is about the batch, not the handler."""

    def step(batch, s):
        return {"y_pred": batch[0], "n": s["n"] + 1}

    def same_leaves(state):
        return "continue", state.replace(step_state={**state.step_state})

    def same_leaves_in_place(state):  # new arrays, written in; the same layout
        state.step_state["n"] = state.step_state["n"] + 0

    x = np.concatenate([b[0] for b in DATA])[:14]
    y = np.concatenate([b[1] for b in DATA])[:14]
    ragged = fl.data.arrays(x, y, batch_size=4, shuffle=False, drop_remainder=False)
    init = {"y_pred": jnp.zeros((4, x.shape[1]), x.dtype), "n": jnp.int32(0)}
    for handler in (same_leaves, same_leaves_in_place):
        loop = fl.loop(step).handle_event("iteration_completed", handler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ragged batch's own warning
            with pytest.raises(ValueError, match=r"\['y_pred'\]: float32\[4, 3\]") as caught:
                loop.run(ragged, init)
        assert not any("a handler of" in note for note in caught.value.__notes__), handler


def test_a_step_state_a_handler_wrote_into_in_place_that_the_step_cannot_keep_is_blamed():
    def add_rate(state):  # a custom step's structure is its own: the step refuses it
        state.step_state["lr"] = jnp.float32(0.05)

    init = {"w": jnp.zeros((3, 1), jnp.float32), "loss": jnp.zeros((), jnp.float32)}
    loop = fl.loop(_linear_step).handle_event("epoch_completed", add_rate)
    with pytest.raises(ValueError, match=r"step_state\['lr'\] is gone") as caught:
        loop.run(DATA, init, epochs=2, fuse=False)
    handed = "the step started from the step state a handler of epoch_completed at epoch 0"
    assert any(handed in note for note in caught.value.__notes__), caught.value.__notes__


def test_a_step_branching_on_a_python_bool_of_its_state_is_told_it_is_traced():
    """An equinox module kept whole in the step state (its Dropout's `inference` flag), or
    a plain bool, raised jax's TracerBoolConversionError alone."""

    def step(batch, s):
        scale = 0.5 if s["training"] else 1.0  # a Python branch on a step state leaf
        return {**s, "w": s["w"] * scale}

    init = {"w": jnp.ones(3), "training": True}
    with pytest.raises(jax.errors.TracerBoolConversionError) as caught:
        fl.loop(step).run(DATA, init)
    assert any("cannot branch on one in Python" in note for note in caught.value.__notes__)

    @jax.jit
    def threshold(state):  # a helper of the user's whose argument is called state
        return 2.0 if state > 0 else 1.0

    def batch_branch(batch, s):  # a tracer of the batch: not the step state's
        return {**s, "w": s["w"] * (2.0 if batch[0].sum() > 0 else 1.0)}

    def helper_branch(batch, s):
        return {**s, "w": s["w"] * threshold(batch[0].sum())}

    for step in (batch_branch, helper_branch):
        with pytest.raises(jax.errors.TracerBoolConversionError) as caught:
            fl.loop(step).run(DATA, init)
        assert not any("branch on one" in n for n in getattr(caught.value, "__notes__", []))

    def loops_over(batch, s):  # range() of a traced int
        return {**s, "w": s["w"] * sum(1.0 for _ in range(s["n"]))}

    with pytest.raises(jax.errors.TracerIntegerConversionError) as caught:
        fl.loop(loops_over).run(DATA, {"w": jnp.ones(3), "n": 2})
    assert any("cannot branch on one in Python" in note for note in caught.value.__notes__)


def test_an_init_fn_failing_on_the_init_state_run_did_not_get_is_told_to_give_one():
    def init_fn(batch, seed):
        return {"key": jax.random.PRNGKey(seed)}  # run(data) gives no seed: None

    loop = fl.loop(lambda batch, s: s, init_fn)
    with pytest.raises(ValueError, match="None is not a valid value") as caught:
        loop.run(DATA)
    assert any("e.g. loop.run(data, 0) for a seed" in n for n in caught.value.__notes__)
    assert loop.run(DATA, 0).status == "completed"

    def own_bug(batch, _):  # ignores init_state, and fails for a reason of its own
        return {"w": batch["x"]}  # a tuple batch

    with pytest.raises(TypeError) as caught:
        fl.loop(lambda batch, s: s, own_bug).run(DATA)
    assert not any("for a seed" in n for n in getattr(caught.value, "__notes__", []))


def test_custom_metric_of_a_missing_scalar_is_a_clear_error():
    loop = counter_loop().metric("loss")
    with pytest.raises(ValueError, match="loss"):
        loop.run(DATA, counter_init())


def test_a_step_states_own_entry_named_like_a_built_in_metric_is_told_how_to_keep_it():
    def step(batch, s):
        x, y = batch
        return {"n": s["n"] + 1, "accuracy": jnp.mean((x[:, 0] > 0) == (y > 0)) * 1.0}

    init = {"n": jnp.int32(0), "accuracy": jnp.float32(0)}
    with pytest.raises(ValueError, match=r"Loop.metric\('train_accuracy', name='accuracy'\)"):
        fl.loop(step).metric("accuracy").run(DATA, init)

    def renamed(batch, s):  # the fix the message names
        out = step(batch, {"n": s["n"], "accuracy": s["train_accuracy"]})
        return {"n": out["n"], "train_accuracy": out["accuracy"]}

    init = {"n": jnp.int32(0), "train_accuracy": jnp.float32(0)}
    state = fl.loop(renamed).metric("train_accuracy", name="accuracy").run(DATA, init)
    assert list(state.metrics) == ["accuracy"]


@pytest.mark.parametrize("value", ["run-a", object()])
def test_a_step_state_leaf_no_device_holds_is_named(value):
    def step(batch, s):
        return {**s, "n": s["n"] + 1}

    with pytest.raises(ValueError, match=r"step_state\['name'\] is a .*closure"):
        fl.loop(step).run(DATA, {"n": jnp.int32(0), "name": value})


def test_custom_loop_jit_false_matches_jit_true():
    data = _regression_data()
    init = {"w": np.zeros(3, np.float32), "loss": np.float32(0), "seen": np.int32(0)}
    loop = fl.loop(_sgd_step).metric("loss")
    compiled = loop.run(data, init, epochs=2)
    eager = loop.run(data, init, epochs=2, jit=False)
    assert_tree_close(compiled.step_state, eager.step_state)
    for epoch in range(2):
        assert eager.history[epoch]["loss"] == pytest.approx(
            compiled.history[epoch]["loss"], rel=1e-5
        )
    assert eager.event_counts == compiled.event_counts


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_metric_function_reads_the_labels_a_step_keeps_with_its_predictions(fuse):
    """A step that flips its inputs (augmentation) keeps the flipped labels as "y_true"
    beside its "y_pred": a metric of (y_true, y_pred) compared the flipped predictions
    with the batch's own labels, and counted the wrong pixels in silence."""

    def step(batch, s):
        x, y = batch
        return {"y_true": y[:, ::-1], "y_pred": x[:, ::-1]}

    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    data = [(x, x)] * 3  # y_pred == y_true only where both are flipped
    init = {"y_true": jnp.zeros_like(x), "y_pred": jnp.zeros_like(x)}
    same = lambda t, p: jnp.mean(t == p, axis=-1)  # noqa: E731
    state = fl.loop(step).metric(same, name="same").run(data, init, fuse=fuse)
    assert state.metrics["same"] == 1.0

    def with_temperature(batch, s):  # y_pred with a scalar leaf beside its (B, F) one
        x, y = batch
        return {"y_true": y[:, ::-1], "y_pred": {"out": x[:, ::-1], "temp": jnp.float32(1)}}

    init = {"y_true": jnp.zeros_like(x), "y_pred": {"out": jnp.zeros_like(x), "temp": 0.0}}
    by_out = lambda t, p: jnp.mean(t == p["out"], axis=-1)  # noqa: E731
    state = fl.loop(with_temperature).metric(by_out, name="same").run(data, init, fuse=fuse)
    assert state.metrics["same"] == 1.0

    # A scalar "y_true", a counter of the step's own, is no labels: the batch's are read.
    def counting(batch, s):
        x, _ = batch
        return {"y_true": s["y_true"] + 1.0, "y_pred": x[:, 0]}

    init = {"y_true": jnp.float32(0), "y_pred": jnp.zeros(6, jnp.float32)}
    data = [(x, x[:, 0] + 1.0)] * 3
    gap = lambda t, p: jnp.abs(t - p)  # noqa: E731
    loop = fl.loop(counting).metric(gap, name="gap").metric("mae").metric("y_true")
    state = loop.run(data, init, fuse=fuse)
    assert state.metrics == {"gap": 1.0, "mae": 1.0, "y_true": 2.0}


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_metric_named_like_the_loops_own_entries_reads_the_step_state(fuse):
    # The loop also keeps the batch's labels as "y_true" and the state as "step_state":
    # a step state's own keys of those names are the user's, and are what is read.
    def step(batch, s):
        return {"y_true": s["y_true"] + 1.0, "step_state": s["step_state"] + 2.0}

    init = {"y_true": jnp.float32(0), "step_state": jnp.float32(0)}
    data = [(x, np.full_like(y, 100)) for x, y in DATA[:4]]
    state = fl.loop(step).metric("y_true").metric("step_state").run(data, init, fuse=fuse)
    assert state.metrics == {"y_true": 2.5, "step_state": 5.0}


def test_a_metric_of_a_non_scalar_entry_and_keras_spellings_on_a_custom_loop():
    def step(batch, s):
        x, y = batch
        return {"y_pred": x[:, 0], "vec": s["vec"] + 1.0}

    init = {"y_pred": jnp.zeros(4), "vec": jnp.zeros(2)}
    data = [(x, x[:, 0] + 1.0) for x, _ in DATA[:4]]
    with pytest.raises(ValueError, match=r"reads step_state\['vec'\], which has shape \(2,\)"):
        fl.loop(step).metric("vec").run(data, init)

    # A dict of losses (a GAN's) or a typed key: named, with the fix, not as a metric function.
    def with_entries(batch, s):
        return {**step(batch, s), "losses": {"d": s["vec"][0], "g": s["vec"][1]}, "key": s["key"]}

    init2 = {**init, "losses": {"d": jnp.float32(0), "g": jnp.float32(0)}, "key": jax.random.key(0)}
    for name, what in (("losses", "a dict"), ("key", "a PRNG key")):
        with pytest.raises(ValueError, match=rf"step_state\['{name}'\], which is {what}, not a"):
            fl.loop(with_entries).metric(name).run(data, init2)
    # "mae" is the built-in metric here too, as on a trainer: not a step state key.
    state = fl.loop(step).metric("mae").run(data, init)
    assert state.metrics["mae"] == pytest.approx(1.0)


def test_a_loss_spelt_as_keras_does_is_read_from_a_custom_steps_state():
    # "binary_crossentropy" is Keras's spelling of a loss, not a built-in metric: like
    # "binary_cross_entropy", a custom loop reads the step state's own entry of that name.
    def step(batch, s):
        return {key: s[key] + 1.0 for key in s}

    keys = ("binary_crossentropy", "binary_cross_entropy", "sparse_categorical_crossentropy")
    built = fl.loop(step)
    for key in keys:
        built = built.metric(key)
    state = built.run(DATA[:3], {key: jnp.float32(i) for i, key in enumerate(keys)})
    assert state.metrics == pytest.approx({key: i + 2.0 for i, key in enumerate(keys)})


def test_a_loop_built_directly_from_a_step_function_names_the_factories():
    def step(batch, s):
        return s

    with pytest.raises(TypeError, match=r"Use fl.loop\(step_fn, init_fn\).*fl.trainer"):
        fl.Loop(step)
    assert fl.Loop(fl.loop(step).program).program.kind == "custom"


def test_a_step_taking_its_arguments_the_other_way_round_is_told_the_order():
    def step(s, batch):
        return {"n": s["n"] + 1}

    with pytest.raises(TypeError) as caught:
        fl.loop(step).run(DATA, {"n": jnp.int32(0)})
    assert any("step_fn(batch, step_state)" in note for note in caught.value.__notes__)


def test_validate_on_a_step_state_without_params_names_the_entry_it_reads():
    def step(batch, s):
        return {"weights": s["weights"], "y_pred": batch[0]}

    init = {"weights": jnp.zeros(3), "y_pred": jnp.zeros_like(DATA[0][0])}
    loop = fl.loop(step).metric("accuracy").validate(tiny_mlp(), DATA[:2])
    with pytest.raises(ValueError, match=r"step_state\['params'\].*keys: \['weights', 'y_pred'\]"):
        loop.run(DATA, init)


def test_a_ragged_batch_on_a_custom_loop_is_told_how_its_metrics_weigh_it():
    x = np.concatenate([b[0] for b in DATA])[:14]
    y = np.concatenate([b[1] for b in DATA])[:14]
    data = fl.data.arrays(x, y, batch_size=4, shuffle=False, drop_remainder=False)
    with pytest.warns(UserWarning, match=r"mean over steps \(the short batch counts as one\)"):
        counter_loop().run(data, counter_init())


def test_a_step_state_returned_by_a_fused_iteration_handler_is_said_to_be_discarded():
    def step(batch, s):
        return {"n": s["n"] + s["inc"], "inc": s["inc"]}

    init = {"n": jnp.int32(0), "inc": jnp.int32(1)}
    stopped = {"n": jnp.int32(0), "inc": jnp.int32(0)}
    loop = fl.loop(step).handle_event(
        "iteration_completed", lambda s: ("continue", s.replace(step_state=stopped)), {"once": 2}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unfused, it is taken: nothing to say
        assert int(loop.run(DATA, init).step_state["n"]) == 0
    with pytest.warns(UserWarning, match=r"returned a step state in a fused run: it is discarded"):
        assert int(loop.run(DATA, init, fuse=3).step_state["n"]) == len(DATA)


def test_a_step_written_state_first_is_told_the_order():
    """flax/optax habit: `train_step(state, batch)`; unpacking the batch then fails on the
    state dict with a bare ValueError, which gets fuseloop's note."""

    def train_step(state, batch):
        x, y = batch  # the step state dict: too many values to unpack
        return {**state, "n": state["n"] + 1}

    with pytest.raises(ValueError, match="too many values") as caught:
        fl.loop(train_step).run([(np.zeros((2, 3)), np.zeros(2))], {"n": 0, "a": 1, "b": 2})
    assert any("step_fn(batch, step_state)" in note for note in caught.value.__notes__)
