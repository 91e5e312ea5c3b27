"""User mistakes found by a bug hunt get a clear ValueError at the right moment: a metric's
non-str name, `mlp(16)`, a file given to `load_state`, x of the wrong size to `predict`, a
model class instead of an instance, fusion hints that suggest only what works, `fuse=None`,
a loss returning a tuple, and a population State where one member's is needed."""

from __future__ import annotations

import re
import warnings
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fuseloop as fl

SPARSE = "sparse_categorical_cross_entropy"
_RNG = np.random.RandomState(0)
X = _RNG.randn(32, 8).astype(np.float32)
Y = (np.arange(32) % 3).astype(np.int32)
BATCHES = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 32, 8)]


def model() -> nn.Module:
    return fl.models.mlp([8, 3])


def trainer() -> fl.Loop:
    return fl.trainer(model(), SPARSE, "adam")


def test_a_metric_name_that_is_not_a_str_is_refused_by_the_builder():
    for name in (5, ""):
        with pytest.raises(ValueError, match=r"name=.* must be a non-empty str"):
            trainer().metric("accuracy", name=name)


def test_mlp_of_an_int_names_features_and_shows_the_list_form():
    with pytest.raises(ValueError, match=re.escape("features=16 must be") + ".*mlp\\(\\[16\\]\\)"):
        fl.models.mlp(16)  # type: ignore[arg-type]


def test_load_state_of_a_file_says_it_is_a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match=r"is a file, not a save.*fl\.save_state"):
        fl.load_state(path)


def test_predict_with_x_of_another_size_says_x_does_not_fit():
    state = trainer().run(BATCHES)
    with pytest.raises(ValueError, match=r"^x does not fit the model .*variables_or_state"):
        fl.predict(model(), state, X[:, :4])


class Identity(nnx.Module):
    def __call__(self, x):
        return x


def test_a_model_class_is_refused_where_the_model_is_adapted():
    with pytest.raises(ValueError, match=r"model=MLP is a module class.*MLP\(\)"):
        fl.trainer(type(model()), SPARSE, "adam")
    with pytest.raises(ValueError, match=r"model=Identity is a module class.*Identity\(\)"):
        fl.evaluator(Identity)


def test_fusion_hints_suggest_fuse_false_only_where_it_works():
    shape = [BATCHES[0], BATCHES[1], (X[:8, :4], Y[:8]), BATCHES[3]]  # a feature-axis change
    cast = [BATCHES[0], BATCHES[1], (X[:8].astype(np.float16), Y[:8]), BATCHES[3]]
    short = BATCHES[:3] + [(X[:5], Y[:5])]  # a short batch: the unfused loop takes it
    for data in (shape, cast):
        with pytest.raises(fl.FusionError) as info:
            trainer().run(data, fuse=4)
        assert "fuse=False" not in str(info.value)
    with pytest.raises(fl.FusionError, match="make the batches uniform"):
        trainer().run(shape, fuse=4)
    with pytest.raises(fl.FusionError, match="use fuse=False"):
        trainer().run(short, fuse=4)


def test_fuse_none_is_refused_naming_the_accepted_values():
    with pytest.raises(ValueError, match=r"fuse=None .*fuse=False.*'auto', or 'run'"):
        trainer().run(BATCHES, fuse=None)  # type: ignore[arg-type]


def test_a_loss_returning_a_tuple_gets_the_scalar_message():
    def with_aux(y_true, y_pred):
        value = optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true).mean()
        return value, {"aux": value}

    with pytest.raises(ValueError, match=r"returned tuple .*must return a scalar"):
        fl.trainer(model(), with_aux, "adam").run(BATCHES)


def test_a_population_state_points_to_member():
    state = trainer().run(BATCHES, population=2)
    with pytest.raises(ValueError, match=r"population of 2 members.*state\.member\(i\)"):
        fl.evaluator(model(), SPARSE).run(BATCHES, state)
    with pytest.raises(ValueError, match=r"population of 2 members.*state\.member\(i\)"):
        fl.models.trained(model(), state)
    assert fl.models.trained(model(), state.member(1))(X[:2]).shape == (2, 3)
    with pytest.raises(ValueError, match=r"leading axis of 2 .*population's State itself"):
        fl.predict(model(), state.params, X)  # the params without their State
    # An evaluator given the params is told the form that works for it (not the State alone).
    with pytest.raises(ValueError, match=r"run\(data, state, population=2\)"):
        fl.evaluator(model(), SPARSE).run(BATCHES, state.params)
    assert fl.evaluator(model(), SPARSE).run(BATCHES, state, population=2).status == "completed"
    assert fl.predict(model(), state, X).shape == (2, 32, 3)


def test_the_replayed_state_note_is_added_only_to_a_read_of_the_missing_step_state():
    class Broke(Exception):
        pass

    def reads_params(state: fl.State) -> None:
        if state.iteration == 2:
            state.params["params"]  # noqa: B018 - None in a fused chunk's replay

    def raises_its_own(state: fl.State) -> None:
        if state.iteration == 2:
            raise Broke("the handler's own error")

    for handler, error in ((reads_params, TypeError), (raises_its_own, Broke)):
        with pytest.raises(error) as info:
            trainer().handle_event("iteration_completed", handler).run(BATCHES, fuse=4)
        notes = "\n".join(info.value.__notes__)
        assert "raised by handler" in notes
        assert ("has no step state" in notes) == (handler is reads_params)


def test_an_optimizer_state_that_changes_dtype_names_the_optimizer_and_a_fix_that_works():
    class HalfLayer(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            hidden = nn.Dense(16, param_dtype=jnp.bfloat16)(x)
            return nn.Dense(3)(nn.relu(hidden))

    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    with pytest.raises(ValueError, match=r"opt_state.*give the trainer a named optimizer"):
        fl.trainer(HalfLayer(), SPARSE, optimizer).run(BATCHES)
    state = fl.trainer(HalfLayer(), SPARSE, "adam").run(BATCHES)  # the fix it names
    assert state.status == "completed"


def test_a_plain_pairs_params_that_would_never_train_are_refused():
    def apply(p: Any, x: Any) -> Any:
        return x @ p["params"]["w"] + p["b"]

    def with_entries(rng: Any, x: Any) -> Any:  # "b" beside "params" would stay frozen
        return {"params": {"w": jnp.zeros((8, 3))}, "b": jnp.zeros(3)}

    with pytest.raises(ValueError, match=r"'params' entry and others \(\['b'\]\)"):
        fl.trainer((with_entries, apply), SPARSE, "sgd").run(BATCHES)

    def with_an_int(rng: Any, x: Any) -> Any:
        return {"w": jnp.zeros((8, 3)), "k": jnp.array(2)}

    with pytest.raises(ValueError, match=r"params\['k'\] has dtype int32"):
        fl.trainer((with_an_int, lambda p, x: x @ p["w"] * p["k"]), SPARSE, "sgd").run(BATCHES)
    nested = {"params": {"w": jnp.zeros((8, 3)), "b": jnp.zeros(3)}}  # every leaf trains
    state = fl.trainer(
        (lambda rng, x: nested, lambda p, x: x @ p["params"]["w"] + p["params"]["b"]), SPARSE, "sgd"
    ).run(BATCHES)
    assert np.any(np.asarray(state.params["params"]["b"]) != 0)


class _TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, a, b):
        return nn.Dense(3)(a) + nn.Dense(3)(b)


class _OneTuple(nn.Module):
    @nn.compact
    def __call__(self, x):
        a, b = x
        return nn.Dense(3)(a) + nn.Dense(3)(b)


def test_a_model_taking_separate_inputs_is_told_how_x_is_passed_and_the_fix_trains():
    data = fl.data.arrays((X[:, :4], X[:, 4:]), Y, batch_size=8)
    with pytest.raises(ValueError, match=r"missing 1 required.*model\(x\).*a, b = x"):
        fl.trainer(_TwoInputs(), SPARSE, "adam").run(data)
    # A dict unpacks to its keys: the fix indexes it (`a, b = x` gave the key strings).
    named = fl.data.arrays({"tokens": X[:, :4], "mask": X[:, 4:]}, Y, batch_size=8)
    with pytest.raises(ValueError, match=r"mask, tokens = x\['mask'\], x\['tokens'\]"):
        fl.trainer(_TwoInputs(), SPARSE, "adam").run(named)
    # Keys that are no variable names (a keyword, a repeated one) are read into others.
    from fuseloop._model_fit_advice import fix_for_x

    missing = TypeError("__call__() missing 1 required positional argument: 'b'")
    assert "input_0, to = x['from'], x['to']" in fix_for_x({"from": 1, "to": 2}, missing, None)
    assert "(def __call__(self, x): tokens = x['tokens'])" in fix_for_x(
        {"tokens": 1}, missing, None
    )
    state = fl.trainer(_OneTuple(), SPARSE, "adam").run(data)
    assert state.status == "completed" and np.isfinite(state.metrics["loss"])


def test_a_state_resumed_with_another_optimizer_names_both_and_the_fix():
    state = trainer().run(BATCHES)  # "adam"
    for other in ("sgd", optax.sgd(0.1), optax.adam(1e-3)):
        with pytest.raises(ValueError, match=r"^init_state: its optimizer state .*ByAdamState"):
            fl.trainer(model(), SPARSE, other).run(BATCHES, state, epochs=2)
    fresh = fl.trainer(model(), SPARSE, "sgd").run(BATCHES, state.params)  # the fix it names
    assert fresh.status == "completed"
    assert trainer().run(BATCHES, state, epochs=2).epoch == 1  # the same optimizer resumes


@pytest.mark.parametrize(
    ("loss", "units", "fix"),
    [(SPARSE, 3, r"np\.unique\(y, return_inverse=True\)"), ("binary_cross_entropy", 1, "0/1")],
)
def test_string_labels_name_their_dtype_and_the_mapping(loss, units, fix):
    words = np.array(["cat", "dog", "eel", "cat"] * 8)
    for data in ([(X[:8], words[:8])] * 2, fl.data.arrays(X, words, batch_size=8)):
        with pytest.raises(ValueError, match=rf"y has dtype <U3, not numbers; .*{fix}"):
            fl.trainer(fl.models.mlp([8, units]), loss, "adam").run(data)
    # Numbers held as Python objects (a mixed pandas frame's .values) are cast, not mapped.
    numbers = np.array([0, 1, 1, 0] * 8, dtype=object)
    cast = "int32" if loss == SPARSE else "float32"
    with pytest.raises(ValueError, match=rf"y has dtype object, .*y\.astype\(np\.{cast}\)$"):
        fl.trainer(fl.models.mlp([8, units]), loss, "adam").run([(X[:8], numbers[:8])])


@pytest.mark.parametrize("fuse", [False, 2])
def test_a_custom_loop_given_text_or_records_names_the_leaf_and_the_fix(fuse):
    def step(batch, s):
        return {"loss": s["loss"] + batch[0].sum()}

    records = np.zeros(8, dtype=[("a", np.float32), ("b", np.int32)])
    cases = [(np.array(["a"] * 8), r"batch\[1\] has dtype <U1, which no device holds; map")]
    cases.append((records, r"rows are records: .*\(batch\[1\]\['a'\], batch\[1\]\['b'\]\)"))
    for labels, message in cases:
        with pytest.raises(ValueError, match=message):
            fl.loop(step).run([(X[:8], labels)] * 2, {"loss": jnp.zeros(())}, fuse=fuse)
    # Run eagerly, the step gets the leaves as they are (it may read them on the host).
    eager = fl.loop(step).run([(X[:8], records)] * 2, {"loss": jnp.zeros(())}, jit=False)
    assert float(eager.step_state["loss"]) == pytest.approx(2 * float(X[:8].sum()))


def test_a_whole_equinox_module_in_a_step_state_is_told_to_partition_it():
    """An equinox module carried whole holds its activation beside its arrays: the message
    said to keep such values in the closure, not how an equinox user does that."""
    import equinox as eqx
    import jax

    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    loop = fl.loop(lambda batch, s: s)
    with pytest.raises(ValueError, match=r"\.activation is a .*eqx\.partition\(model"):
        loop.run([(X[:8], X[:8])], {"params": model})
    for own in ({"name": "text"}, {"scale": abs}):  # a function with no module: no eqx
        with pytest.raises(ValueError, match=r"no device holds: .*handler_metadata\)$"):
            loop.run([(X[:8], X[:8])], {"params": own})


def test_state_replace_of_params_names_the_step_state_it_is_read_from():
    state = fl.State(step_state={"params": {"w": 1.0}, "opt_state": ()})
    with pytest.raises(ValueError, match=r"unknown fields \['params'\].*step_state=\{\*\*state"):
        state.replace(params={"w": 2.0})
    with pytest.raises(ValueError, match=r"unknown fields \['loss'\]; accepted: [a-z_, ]+$"):
        state.replace(loss=1.0)


class _LastStepGRU(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(1)(nn.RNN(nn.GRUCell(4))(x)[:, -1])


@pytest.mark.parametrize("y_shape", [(8, 1), (8,)])
def test_windows_without_a_feature_axis_are_told_to_add_one_not_to_reshape_y(y_shape):
    """nn.RNN reads x of shape (batch, time) as one unbatched sequence: its output has no
    axis of the batch's examples, and the loss's refusal blamed y."""
    y = X[:, :1].reshape((32,) + y_shape[1:])
    batches = [(X[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    with pytest.raises(ValueError) as info:
        fl.trainer(_LastStepGRU(), "mse", "adam").run(batches)
    message = str(info.value)
    assert "x has shape (8, 8), but the model's output of shape (1,)" in message
    assert "x[..., None]" in message and "reshape or transpose y" not in message
    windows = [(x[..., None], t) for x, t in batches]  # the fix the message names
    assert fl.trainer(_LastStepGRU(), "mse", "adam").run(windows).status == "completed"


def test_a_custom_loss_crossing_an_output_without_the_examples_axis_is_told_of_x():
    """x of shape (B,) into a Dense: its output (3,) crosses y (B, 1) in a loss of the
    user's own, whose cross-broadcast refusal hid that x lacks a feature axis."""

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(3)(x)

    x, y = X[:8, 0], X[:8, :1]
    loss = lambda t, p: jnp.mean((p - t) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"x has shape \(8,\), one axis.*give x a feature axis"):
        fl.trainer(Head(), loss, "sgd").run([(x, y)])


def test_an_output_that_merges_the_examples_axis_keeps_the_message_about_y():
    """Tokens flattened to (B*T, C) still hold the examples: y's shape is what misfits."""

    class Tokens(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(4)(x).reshape(-1, 4)

    x, y = np.zeros((8, 5, 3), np.float32), np.zeros((8, 5), np.int32)
    with pytest.raises(ValueError, match=r"y has shape \(8, 5\).*output of shape \(40, 4\)"):
        fl.trainer(Tokens(), SPARSE, "adam").run([(x, y)])


class _Energy(nn.Module):
    """One value for the whole batch, on purpose (an energy, the model's own loss)."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(1)(x).mean()


def test_a_loss_that_returns_no_scalar_is_told_so_whatever_the_models_output():
    def unreduced(y_true: Any, y_pred: Any) -> Any:
        return (y_true - y_pred) ** 2  # forgot .mean()

    with pytest.raises(ValueError, match=r"loss 'unreduced' returned shape \(8,\).*\.mean\(\)"):
        fl.trainer(_Energy(), unreduced, "sgd").run([(X[:8], X[:8, 0])])


def test_one_example_of_a_tree_or_in_a_run_is_told_the_fix_that_fits_it():
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(3)(x["a"].reshape(x["a"].shape[0], -1))

    windows = {"a": _RNG.randn(6, 4, 2).astype(np.float32)}
    trained = fl.trainer(Two(), SPARSE, "sgd").run([(windows, Y[:6])])
    with pytest.raises(ValueError, match=r"jax\.tree\.map\(lambda a: a\[None\], x\)"):
        fl.predict(Two(), trained, {"a": windows["a"][0]})
    one_each = [({"a": w}, Y[:4]) for w in windows["a"]]  # single examples, per-step labels
    with pytest.raises(ValueError, match=r"one example.*np\.stack\(xs\), np\.stack\(ys\)"):
        fl.evaluator(Two(), SPARSE).run(one_each, trained.params)


def test_a_beginners_mix_ups_of_the_builders_arguments_are_each_told_the_fix():
    model, loss = fl.models.mlp([3]), "sparse_categorical_cross_entropy"
    with pytest.raises(ValueError, match=r"fl.models.mlp makes a model: call it"):
        fl.trainer(fl.models.mlp, loss, "adam")
    with pytest.raises(ValueError, match=r"adam looks like a function that makes one: call it"):
        fl.trainer(model, loss, optax.adam)
    with pytest.raises(ValueError, match=r"it is an optimizer: the order is fl.trainer\(model, lo"):
        fl.trainer(model, optax.adam(1e-3), loss)
    data = [(np.ones((2, 3), np.float32), np.zeros(2, np.int32))]
    with pytest.raises(ValueError, match=r"For 10 epochs: run\(data, epochs=10\)"):
        fl.trainer(model, loss, "adam").run(data, 10)


def test_a_keras_callback_method_as_a_handler_is_refused_when_attached():
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "adam")

    def on_epoch_end(epoch, logs=None):  # Keras's: it would get the State as `epoch`
        print(epoch + 1)

    with pytest.raises(ValueError, match=r"on_epoch_end\(epoch, logs=None\) is a Keras callb"):
        loop.handle_event("epoch_completed", on_epoch_end)
    with pytest.raises(ValueError, match=r"gets one State: def fn\(state\)"):
        loop.observe("epoch_completed", lambda batch, logs=None: None)


def test_a_loss_or_metric_naming_the_prediction_first_is_warned_and_its_failure_says_why():
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "adam")

    def hits(y_pred, y_true):  # optax's order: argmax of the labels, silently
        return (jnp.argmax(y_pred, -1) == y_true).astype(jnp.float32)

    with pytest.warns(UserWarning, match=r"metric hits\(y_pred, y_true\): fuseloop calls me"):
        loop.metric(hits)

    def swapped(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    with pytest.warns(UserWarning, match=r"its first parameter, 'logits', is named for the pr"):
        trainer = fl.trainer(fl.models.mlp([3]), swapped, "adam")
    data = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))]
    with pytest.raises(ValueError, match=r"first parameter is 'logits', but fuseloop calls loss"):
        trainer.run(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.metric(lambda y_true, y_pred: y_pred, name="as_named")
        loop.metric(lambda ground_truth_score, y_hat: y_hat, name="truth_first")
        loop.metric(lambda predecessor_labels, y: y, name="a_word_not_pred")
        with pytest.raises(ValueError, match=r"optax's losses take"):  # refused, not warned
            fl.trainer(fl.models.mlp([3]), optax.softmax_cross_entropy_with_integer_labels, "sgd")


def test_other_callables_in_the_model_or_optimizer_place_get_no_call_it_hint():
    loss = "sparse_categorical_cross_entropy"
    with pytest.raises(ValueError, match=r"is not a model") as refused:
        fl.trainer(fl.data.arrays, loss, "adam")
    assert "call it" not in str(refused.value)
    with pytest.raises(ValueError, match=r"must be a name") as refused:
        fl.trainer(fl.models.mlp([3]), loss, optax.exponential_decay(0.1, 10, 0.5))
    assert "call it" not in str(refused.value)


def test_a_built_in_loss_or_metric_on_data_without_targets_is_told_to_give_some():
    # They were told to read "y_true[0]" of a None y, the loss wrapped in "Give y the shape".
    x = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
    data = fl.data.arrays(x, None, batch_size=8)
    fix = r"the data holds none \(y is None\).*fl.data.arrays\(x, x, \.\.\.\)"
    with pytest.raises(ValueError, match=fix + r".*\.metric\(lambda"):
        fl.trainer(fl.models.mlp([6]), lambda y, r: (r**2).mean(), "sgd").metric("mae").run(data)
    with pytest.raises(ValueError, match=r"^data: loss 'mean_squared_error' .*" + fix):
        fl.trainer(fl.models.mlp([6]), "mse", "sgd").run(data)
    labels = r"holds none.*give the data its labels, fl.data.arrays\(x, y, \.\.\.\)"
    with pytest.raises(ValueError, match=labels):
        fl.trainer(fl.models.mlp([6]), "sparse_categorical_cross_entropy", "sgd").run(data)
