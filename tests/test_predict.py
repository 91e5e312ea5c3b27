"""`fl.predict`: eval-mode outputs for every example in order, ragged last batch included."""

from __future__ import annotations

import argparse
import functools
import logging
import random
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from fuseloop._predict import predict


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=not train)(nn.relu(x)))


RNG = np.random.default_rng(0)
X = RNG.normal(size=(23, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 23).astype(np.int32)


@pytest.fixture(scope="module")
def state():
    source = fl.data.arrays(X, Y, batch_size=4)
    return fl.trainer(Net(), "sparse_categorical_cross_entropy", "adam").run(source, epochs=2)


def expected(state):
    return np.asarray(Net().apply(state.params, X, train=False))


@pytest.mark.parametrize("fuse", [True, False, 2])
@pytest.mark.parametrize("batch_size", [4, 5, 256])
def test_every_example_in_order(state, fuse, batch_size):
    out = predict(Net(), state, X, batch_size=batch_size, fuse=fuse)
    assert out.shape == (23, 3)
    np.testing.assert_allclose(out, expected(state), rtol=1e-5, atol=1e-6)


def test_fused_and_unfused_agree_bitwise(state):
    a = predict(Net(), state.params, X, batch_size=4, fuse=True)
    b = predict(Net(), state.params, X, batch_size=4, fuse=False)
    np.testing.assert_array_equal(a, b)


def test_host_inputs_are_moved_explicitly_as_a_runs_batches_are(state):
    # Under JAX's transfer guard a run trains; predict failed on its own implicit transfer.
    with jax.transfer_guard("disallow"):
        guarded = predict(Net(), state, X, batch_size=4)
    np.testing.assert_array_equal(guarded, predict(Net(), state, X, batch_size=4))


def test_batch_sources(state):
    pairs = [(X[i : i + 6], Y[i : i + 6]) for i in range(0, 23, 6)]
    inputs = [X[i : i + 6] for i in range(0, 23, 6)]
    ordered = fl.data.arrays(X, Y, batch_size=6, shuffle=False, drop_remainder=False)
    generated = (x for x in inputs)
    for source in (pairs, inputs, iter(pairs), lambda: iter(inputs), ordered, _refilled, generated):
        with warnings.catch_warnings():  # an iterator is not read as a pytree (JAX warns)
            warnings.simplefilter("error")
            got = predict(Net(), state, source)
        np.testing.assert_allclose(got, expected(state), rtol=1e-5, atol=1e-6)


def _refilled():
    """A loader that refills one array for every batch (docs/data.md allows it)."""
    buffer = np.empty((6, 5), np.float32)
    for i in range(0, 18, 6):
        buffer[:] = X[i : i + 6]
        yield buffer
    yield X[18:]


def test_inputs_of_different_sizes_are_named_leaf_by_leaf():
    model = fl.models.mlp([2])
    variables = model.init(jax.random.PRNGKey(0), np.zeros((1, 3), np.float32))
    x = {"a": np.zeros((10, 3), np.float32), "b": np.zeros((9, 3), np.float32)}
    with pytest.raises(ValueError, match=r"\(x\['a'\]: 10, x\['b'\]: 9\)"):
        fl.predict(lambda v, x: model.apply(v, x["a"]), variables, x)


def test_pytree_inputs_and_outputs():
    init = lambda rng, x: {"w": np.ones((5, 2), np.float32)}  # noqa: E731
    apply = lambda p, x: {"a": x["u"] @ p["w"], "b": x["v"].sum(-1)}  # noqa: E731
    x = {"u": X, "v": X[:, :2]}
    out = predict((init, apply), {"w": np.ones((5, 2), np.float32)}, x, batch_size=7)
    np.testing.assert_allclose(out["a"], X @ np.ones((5, 2), np.float32), rtol=1e-6)
    np.testing.assert_allclose(out["b"], X[:, :2].sum(-1), rtol=1e-6)


def test_a_list_of_a_two_input_models_inputs_is_refused_not_read_as_batches():
    init = lambda rng, x: {"w": np.ones((5, 2), np.float32)}  # noqa: E731
    apply = lambda p, x: (x[0] * x[1]) @ p["w"]  # noqa: E731
    params = {"w": np.ones((5, 2), np.float32)}
    assert predict((init, apply), params, (X, X), batch_size=7).shape == (len(X), 2)
    # Keras's habit, predict([a, b]): a list is a list of batches, each batch one array,
    # and the model's output then has no row per example.
    with pytest.raises(ValueError, match=r"not one row per example.*tuple \(a, b\)"):
        predict((init, apply), params, [X, X])


def test_a_list_of_inputs_that_misfits_the_model_is_told_how_a_list_is_read():
    # Two inputs of one row length each joined into one batch: the first chunk's check
    # says the x misfits, and notes that the list was read as batches.
    init = lambda rng, x: {"w": np.ones((5, 2), np.float32)}  # noqa: E731
    apply = lambda p, x: x @ p["w"]  # noqa: E731
    params = {"w": np.ones((5, 2), np.float32)}
    with pytest.raises(ValueError, match="does not fit the model") as caught:
        predict((init, apply), params, [X[:, :3], X[:, 1:4]])
    assert any("read as a list of batches" in note for note in caught.value.__notes__)
    # Inputs of other widths were refused as batches to pad, with no note (hunt151).
    with pytest.raises(ValueError, match="pad every batch to one length") as caught:
        predict((init, apply), params, [X[:, :3], X[:, :2]])
    assert any("read as a list of batches" in note for note in caught.value.__notes__)


def test_a_bound_linen_module_gives_its_weights_and_a_called_nnx_module_is_told_to_pop():
    # fl.models.trained's bound module was refused as a linen module with no weights.
    model = fl.models.mlp([4, 2])
    variables = model.init(jax.random.key(0), X[:2])
    bound = fl.models.trained(model, variables)
    np.testing.assert_array_equal(predict(model, bound, X), predict(model, variables, X))
    # An nnx module called once (a shape check) holds what it sowed, which the template
    # lacks: it was blamed on x.
    from flax import nnx

    class Sows(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(X.shape[1], 2, rngs=rngs)

        def __call__(self, x):
            self.sow(nnx.Intermediate, "h", x)
            return self.linear(x)

    called = Sows(nnx.Rngs(1))
    called(X[:2])
    with pytest.raises(ValueError, match=r"sowed \(h, an nnx.Intermediate\).*nnx.pop"):
        predict(Sows(nnx.Rngs(0)), called, X)
    nnx.pop(called, nnx.Intermediate)
    assert predict(Sows(nnx.Rngs(0)), called, X).shape == (len(X), 2)


def test_bad_arguments(state):
    with pytest.raises(ValueError, match="fuse=0"):
        predict(Net(), state, X, fuse=0)
    with pytest.raises(ValueError, match="batch_size=0"):
        predict(Net(), state, X, batch_size=0)
    with pytest.raises(ValueError, match="no batch"):
        predict(Net(), state, [])
    # A custom loop's State keeping its variables under another key: it was told only
    # "the State holds no params".
    custom = fl.State(step_state={"theta": state.params, "opt": ()})
    keys = r"without a 'params' entry \(its keys: \['opt', 'theta'\]\)"
    with pytest.raises(ValueError, match=keys):
        predict(Net(), custom, X)
    np.testing.assert_array_equal(
        predict(Net(), custom.step_state["theta"], X), predict(Net(), state, X)
    )  # the fix it names
    with pytest.raises(ValueError, match=r"holds no step state .*the State the run returned"):
        predict(Net(), fl.State(epoch=1), X)


def test_second_call_does_not_recompile(state):
    predict(Net(), state, X, batch_size=4)
    model = Net()
    predict(model, state, X, batch_size=4)
    from fuseloop._predict import _chunk_program

    program, _ = _chunk_program(model)
    size = program._cache_size()
    predict(model, state, X, batch_size=4)
    assert program._cache_size() == size


def test_equinox_and_nnx_models_predict_in_eval_mode():
    import equinox as eqx
    from flax import nnx

    class Eqx(eqx.Module):
        dense: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __init__(self):
            self.dense = eqx.nn.Linear(5, 3, key=jax.random.PRNGKey(0))
            self.drop = eqx.nn.Dropout(0.5)

        def __call__(self, x, key=None):
            return self.drop(self.dense(x), key=key)

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(5, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dense(x))

    for model in (Eqx(), Nnx(nnx.Rngs(0))):
        state = fl.trainer(model, "sparse_categorical_cross_entropy", "sgd").run([(X[:8], Y[:8])])
        out = predict(model, state, X, batch_size=8)
        np.testing.assert_allclose(
            out, np.asarray(fl.models.as_model(model).apply(state.params, X)), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("device", [False, True])
def test_an_arrays_source_predicts_every_row_in_its_order(state, device):
    # Shuffled and dropping its short last batch (the defaults): the source a user trains
    # on. Its epochs would give 20 of the 23 rows in another order.
    source = fl.data.arrays(X, Y, batch_size=4, device=device)
    out = predict(Net(), state, source, fuse=2)
    np.testing.assert_allclose(out, expected(state), rtol=1e-6, atol=1e-6)


def test_a_source_of_pairs_meant_as_two_inputs_is_told_it_was_read_as_x_and_y():
    """A list of x-only batches `(a, b)` is read as (x, y); the model got `a` alone and the
    error said only "too many values to unpack"."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(20, 4)), rng.normal(size=(20, 3))
    model = fl.models.from_functions(
        lambda key, x: {"wa": np.ones((4, 2)), "wb": np.ones((3, 2))},
        lambda v, x: x[0] @ v["wa"] + x[1] @ v["wb"],
    )
    variables = {"wa": np.ones((4, 2)), "wb": np.ones((3, 2))}
    as_pairs = [(a[i : i + 5], b[i : i + 5]) for i in range(0, 20, 5)]
    with pytest.raises(ValueError) as error:
        predict(model, variables, as_pairs)
    assert "read as (x, y)" in "".join(error.value.__notes__)
    wrapped = [((xa, xb), None) for xa, xb in as_pairs]  # the fix the note names
    expected = a @ np.ones((4, 2)) + b @ np.ones((3, 2))
    np.testing.assert_allclose(predict(model, variables, wrapped), expected, rtol=1e-5)


def test_a_few_examples_are_not_padded_to_a_whole_chunk(state, monkeypatch):
    shapes = []
    chunks = fl._predict._chunks

    def recorded(*args):
        for chunk, live in chunks(*args):
            shapes.append(jax.tree.leaves(chunk)[0].shape)
            yield chunk, live

    monkeypatch.setattr(fl._predict, "_chunks", recorded)
    out = predict(Net(), state, X, batch_size=4)  # 5 batches of 4: one chunk of 8, not 32
    np.testing.assert_allclose(out, expected(state), rtol=1e-5, atol=1e-6)
    assert shapes == [(8, 4, 5), (1, 3, 5)]  # and the short last batch on its own
    shapes.clear()
    predict(Net(), state, X[:3], batch_size=256)
    assert shapes == [(1, 3, 5)]


def _centred(params, x):  # each output reads the whole batch
    h = x @ params["w"]
    return h - h.mean(0, keepdims=True)


def test_every_batch_runs_as_it_is_for_a_model_reading_the_whole_batch():
    """A short last batch was padded with zero rows, and a list's batches were cut again
    to the first one's size: a model whose outputs read the batch's other rows (in-batch
    normalisation) predicted other numbers for them than for the batches given."""
    params = {"w": np.ones((5, 2), np.float32)}
    model = (lambda rng, x: params, _centred)
    by_hand = np.concatenate([_centred(params, X[i : i + 4]) for i in range(0, 23, 4)])
    for fuse in (True, False, 2):
        out = predict(model, params, X, batch_size=4, fuse=fuse)
        np.testing.assert_allclose(out, by_hand, rtol=1e-5, atol=1e-5)
    batches = [X[:3], X[3:8], X[8:13], X[13:21], X[21:]]  # sizes 3, 5, 5, 8, 2
    out = predict(model, params, batches, fuse=2)
    np.testing.assert_allclose(
        out, np.concatenate([_centred(params, b) for b in batches]), rtol=1e-5, atol=1e-5
    )


def test_outputs_without_a_row_per_example_and_inputs_without_examples_are_named(state):
    apply = lambda p, x: (x @ p["w"], (x @ p["w"]).sum())  # noqa: E731
    params = {"w": np.ones((5, 2), np.float32)}
    with pytest.raises(ValueError, match=r"output\[1\] for a batch .* shape \(\).*per-example"):
        predict((lambda rng, x: params, apply), params, X)
    for scalar in (np.float32(1.0), np.array(1.0), jax.numpy.ones(())):
        with pytest.raises(ValueError, match=r"x: a scalar .* holds no examples"):
            predict(Net(), state, scalar)
    with pytest.raises(ValueError, match=r"^x=None: pass the inputs"):
        predict(Net(), state, None)
    # Python rows or numbers: a list is a list of batches, and the fix is named.
    for listed in (X.tolist(), [1.0, 2.0]):
        with pytest.raises(ValueError, match=r"no batch axis.*np\.asarray\(x, np\.float32\)"):
            predict(Net(), state, listed)
    with pytest.raises(ValueError, match=r"^variables_or_state=None: pass the trained"):
        predict(Net(), None, X)
    # Neither inputs nor a source: named as predict's x, not as Loop.run's data.
    for neither in ("inputs.npy", 5):
        with pytest.raises(ValueError, match=r"^x=(str|int) is neither an array .*batch source"):
            predict(Net(), state, neither)
    # A dict of inputs with one scalar leaf: that leaf is named, not the dict read as batches.
    pair = (lambda rng, x: {}, lambda v, x: x["a"] * x["t"])
    for number in (np.float32(2.0), 2.0):
        with pytest.raises(ValueError, match=r"^x\['t'\] is a scalar \(shape \(\)\).*np\.full"):
            predict(pair, {}, {"a": X, "t": number})
        # So is it in a list of batches (numpy's "cannot be concatenated" named nothing).
        batches = [({"a": X[:4], "t": number}, None), ({"a": X[4:8], "t": number}, None)]
        with pytest.raises(ValueError, match=r"^x\['t'\] is a scalar .*batches.*np\.full"):
            predict(pair, {}, batches)
        # Sorted first among x's keys, or in a later batch only (review71).
        first = [({"a": number, "b": X[:4]}, None)]
        later = [({"a": X[:4], "t": X[:4, 0]}, None), ({"a": X[4:8], "t": number}, None)]
        for found, source in (("a", first), ("t", later)):
            with pytest.raises(ValueError, match=rf"^x\['{found}'\] is a scalar .*batches"):
                predict(pair, {}, source)


def test_keras_triples_and_a_populations_params_are_named_as_such(state):
    # (x, y, sample_weight) batches are read whole as x, a model of three inputs'.
    triples = [(X[:8], Y[:8], np.ones(8, np.float32)), (X[8:], Y[8:], np.ones(15, np.float32))]
    with pytest.raises(ValueError) as caught:
        predict(Net(), state, triples)
    assert any("tuple of 3 items, all read as x" in note for note in caught.value.__notes__)
    # A tuple of three inputs given as x itself is no batch: no such note.
    with pytest.raises(ValueError) as caught:
        predict(Net(), state, (X, X, X))
    assert not any("tuple of 3" in note for note in getattr(caught.value, "__notes__", []))
    # A population's params without their State, to an evaluator as to predict.
    stacked = jax.tree.map(lambda a: np.stack([a, a]), state.params)
    with pytest.raises(ValueError, match=r"^init_state: These variables have a leading axis of 2"):
        fl.evaluator(Net(), "sparse_categorical_cross_entropy").run([(X, Y)], stacked)
    with pytest.raises(ValueError, match=r"^variables_or_state: these variables have a leading"):
        predict(Net(), stacked, X)


def test_a_module_built_with_its_weights_serves_as_its_variables():
    """An nnx or equinox module passed where variables go gives its own weights; a linen
    module, which holds none, is refused naming what to pass."""
    import equinox as eqx
    from flax import nnx

    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    y = np.zeros(6, np.int32)
    for module in (
        nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
        eqx.nn.Linear(4, 3, key=jax.random.PRNGKey(1)),
    ):
        weights = fl.models.as_model(module).init(None, None)
        expected = fl.predict(module, weights, x)
        np.testing.assert_array_equal(fl.predict(module, module, x), expected)
        evaluator = fl.evaluator(module, "sparse_categorical_cross_entropy")
        assert evaluator.run([(x, y)], module).metrics == evaluator.run([(x, y)], weights).metrics
    with pytest.raises(ValueError, match=r"init_state: a flax.linen module \(MLP\) holds no"):
        fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd").run(
            [(x, y)], fl.models.mlp([3])
        )


def test_inputs_are_narrowed_as_a_run_narrows_them():
    """With 64-bit mode off, predict refuses int64 ids a trainer refuses (they wrapped:
    2**33 + 7 was predicted as 7), warns of float64 as a run does, and takes a big-endian
    array in the machine's byte order (it failed, blaming x's shape)."""
    params = {"w": np.ones((1, 1), np.float32)}
    apply = lambda p, x: jax.tree.leaves(x)[0].astype(np.float32) @ p["w"]  # noqa: E731
    model = (lambda rng, x: params, apply)
    ids = np.array([[7], [2**33 + 7], [3]], np.int64)
    with pytest.raises(ValueError, match=r"x holds int64 values beyond int32's range"):
        fl.trainer(model, "mse", "sgd").run([(ids, np.zeros((3, 1), np.float32))])
    with pytest.raises(ValueError, match=r"^fl.predict: x holds int64 values beyond int32's"):
        predict(model, params, ids)
    values = np.array([[7.0], [1.5], [3.0]])
    with pytest.warns(UserWarning, match=r"^fl.predict: leaf x\['v'\] is float64.*to float32"):
        out = predict(model, params, {"v": values})
    np.testing.assert_array_equal(out, values.astype(np.float32))
    np.testing.assert_array_equal(predict(model, params, {"v": values.astype(">f4")}), out)


class _Scaled:
    """A plain model object (`.init` and `.apply`) whose apply reads an attribute."""

    scale = 1.0

    def init(self, rng, x):
        return {"w": np.ones((x.shape[1], 2), np.float32)}

    def apply(self, variables, x):
        return x @ variables["w"] * self.scale


def test_a_plain_model_object_changed_in_place_is_taken_as_it_is_or_refused():
    """fl.predict kept the program traced with a plain object's old attribute and returned
    the old outputs after `model.scale = 10.0`; a loop built on it trained with the old
    value. predict takes the object as it is; a run of the loop refuses the change."""
    model = _Scaled()
    variables = model.init(None, X)
    before = predict(model, variables, X)
    model.scale = 10.0
    np.testing.assert_allclose(predict(model, variables, X), 10 * before, rtol=1e-6)
    loop = fl.trainer(model, "mean_squared_error", "sgd")
    data = [(X[:8], np.zeros((8, 2), np.float32))]
    assert loop.run(data).status == "completed"
    model.scale = 2.0
    with pytest.raises(ValueError, match=r"\(_Scaled\) changed since the loop.s last run \(scale"):
        loop.run(data)
    assert fl.trainer(model, "mean_squared_error", "sgd").run(data).status == "completed"


class _Configured:
    """Reads its scale from a dict, a numpy array, a config object and its class."""

    factor = 1.0

    def __init__(self):
        self.cfg = {"scale": 1.0}
        self.bias = np.zeros(2, np.float32)
        self.options = argparse.Namespace(offset=0.0)  # a library's object holds values too

    def init(self, rng, x):
        return {"w": np.ones((x.shape[1], 2), np.float32)}

    def apply(self, variables, x):
        scaled = x @ variables["w"] * self.cfg["scale"] * self.factor
        return scaled + self.bias + self.options.offset


@pytest.mark.parametrize("change", ["dict", "array", "config", "class"])
def test_a_plain_model_objects_value_changed_in_place_is_seen_too(change, monkeypatch):
    """Only a reassigned attribute was seen: `model.cfg["scale"] = 5.0`, `model.bias[:] =
    1`, a config object's field or the class's attribute left predict and a run of the
    loop on the old value, in silence."""
    model = _Configured()
    variables = model.init(None, X)
    loop = fl.trainer(model, "mean_squared_error", "sgd")
    data = [(X[:8], np.zeros((8, 2), np.float32))]
    assert loop.run(data).status == "completed"
    predict(model, variables, X)
    if change == "dict":
        model.cfg["scale"] = 5.0
    elif change == "array":
        model.bias[:] = 1.0
    elif change == "config":
        model.options.offset = 1.0
    else:
        monkeypatch.setattr(_Configured, "factor", 5.0)
    expected = model.apply(variables, X)
    np.testing.assert_allclose(predict(model, variables, X), expected, rtol=1e-6)
    with pytest.raises(ValueError, match=r"\(_Configured\) changed since the loop.s last"):
        loop.run(data)


class _Busy(_Scaled):
    """Holds what changes without changing what apply reads: a logger, a host RNG, a
    trace-time cache its own runs fill, a config dict, an array of objects."""

    def __init__(self):
        self.log = logging.getLogger("fuseloop.tests.busy")
        self.rng = random.Random(0)
        self.cache = {}
        self.cfg = {"a": 1.0, "b": 2.0}
        self.table = np.array([("x", 1.0)], dtype=[("name", "O"), ("v", "f4")])

    def apply(self, variables, x):
        self.cache.setdefault(x.shape, len(self.cache))
        return super().apply(variables, x) * self.cfg["a"]


def test_a_plain_model_objects_own_workings_are_no_change():
    """Compared deeply, a logger that logged, a host RNG drawn from or a dict re-inserted
    in another order refused the next run; an array of objects crashed the comparison
    after the run had trained. A cache the loop's own run filled is its programs' own."""
    model = _Busy()
    loop = fl.trainer(model, "mean_squared_error", "sgd")
    data = [(X[:8], np.zeros((8, 2), np.float32))]
    state = loop.run(data)
    model.log.warning("epoch done")
    model.rng.random()
    model.cfg["a"] = model.cfg.pop("a")  # the same items, in another order
    assert loop.run(data, state, epochs=2).status == "completed"
    # Another use that fills the cache (a batch of 5 traced) is a change to this loop,
    # named with the fix; a new loop on the same adapter traces anew and runs.
    predict(model, state, X[:5])
    with pytest.raises(ValueError, match=r"\(cache changed\).*keep such state outside"):
        loop.run(data)
    adapter = fl.models.from_functions(model.init, model.apply)
    first = fl.trainer(adapter, "mean_squared_error", "sgd")
    first.run(data)
    model.cfg["a"] = 2.0
    with pytest.raises(ValueError, match=r"\(cfg changed\)"):
        first.run(data)
    assert fl.trainer(adapter, "mean_squared_error", "sgd").run(data).status == "completed"


def test_a_refused_change_is_refused_again_not_taken_by_the_next_run():
    """The refused run noted the changed object as the programs' own, so the run after it
    trained on the old value in silence."""
    model = _Configured()
    loop = fl.trainer(model, "mean_squared_error", "sgd")
    data = [(X[:8], np.zeros((8, 2), np.float32))]
    loop.run(data)
    model.cfg["scale"] = 100.0
    for _ in range(2):
        with pytest.raises(ValueError, match=r"changed since the loop.s last run \(cfg"):
            loop.run(data)


class _Slotted:
    """A plain model without a __dict__; its normalizer is a callable object."""

    __slots__ = ("scale", "norm")

    def __init__(self):
        self.scale = 1.0
        self.norm = _Normalizer()

    def init(self, rng, x):
        return {"w": np.ones((x.shape[1], 2), np.float32)}

    def apply(self, variables, x):
        return self.norm(x) @ variables["w"] * self.scale


class _Normalizer:
    def __init__(self):
        self.mean = np.zeros(5, np.float32)

    def __call__(self, x):
        return x - self.mean


def test_changes_in_slots_callables_a_handler_or_a_failed_predict_are_seen():
    """A handler's change during a run was noted at its end as the programs' own; a
    callable attribute, a __slots__ object and a failed predict's program were never
    compared: each next use read the old value in silence."""
    data = [(X[:8], np.zeros((8, 2), np.float32))]
    for change in ("scale", "norm"):
        model = _Slotted()
        loop = fl.trainer(model, "mean_squared_error", "sgd")
        loop.run(data)
        if change == "scale":
            model.scale = 10.0
        else:
            model.norm.mean[:] = 1.0
        with pytest.raises(ValueError, match=rf"\({change} changed\)"):
            loop.run(data)
    model = _Scaled()
    setter = lambda state: setattr(model, "scale", 10.0)  # noqa: E731
    loop = fl.trainer(model, "mean_squared_error", "sgd").handle_event("epoch_completed", setter)
    loop.run(data)
    with pytest.raises(ValueError, match=r"\(scale changed\)"):
        loop.run(data)
    model = _EvenOnly()
    variables = model.init(None, X)
    with pytest.raises(ValueError, match="even batches only"):  # after a first chunk
        predict(model, variables, X, batch_size=4)  # 23 examples: a last batch of 3
    model.scale = 3.0
    got = predict(model, variables, X[:20], batch_size=4)
    np.testing.assert_allclose(got, model.apply(variables, X[:20]), rtol=1e-5)


class _EvenOnly(_Scaled):
    def apply(self, variables, x):
        if x.shape[0] % 2:
            raise ValueError("even batches only")
        return super().apply(variables, x)


class _Lazy(_Scaled):
    """Sets its own attributes while it runs: a width noted by init over a class default,
    a trace counter, a cached part."""

    in_features = None
    traces = 0

    @functools.cached_property
    def factor(self):
        return 2.0

    def init(self, rng, x):
        self.in_features = x.shape[1]
        return super().init(rng, x)

    def apply(self, variables, x):
        self.traces += 1
        return super().apply(variables, x) * self.factor


def test_a_plain_model_object_that_sets_its_own_attributes_while_it_runs_is_no_change():
    """The first version compared the object with itself when the loop was built, so an
    init noting the input width was refused at the first run."""
    model = _Lazy()
    loop = fl.trainer(model, "mean_squared_error", "sgd")
    data = [(X[:8], np.zeros((8, 2), np.float32))]
    state = loop.run(data)
    assert loop.run(data, state, epochs=2).status == "completed"
    assert predict(model, state, X).shape == (23, 2) and predict(model, state, X).shape[0] == 23


@pytest.mark.parametrize("fuse", [False, True])
def test_batches_padded_to_their_own_lengths_are_named_with_the_fix(fuse):
    """A dynamic-padding collator pads each batch to its own longest sequence: the rows
    cannot be joined, and numpy's concatenate error named no batch and no fix."""
    model = fl.models.mlp([3])
    variables = model.init(jax.random.key(0), np.zeros((1, 6), np.float32))
    batches = [np.ones((4, 6), np.float32), np.ones((4, 3), np.float32)]
    with pytest.raises(ValueError, match=r"batch 1 of the source holds rows of shapes \(\(3,\),\)"):
        fl.predict(model, variables, batches, fuse=fuse)


def test_outputs_whose_other_axes_follow_the_batch_are_named_where_batches_differ():
    """In-batch similarities (B, B) with a short last batch: numpy's concatenate error named
    no output and no fix; batches of one size join as they are."""
    params = {"w": np.ones((5, 2), np.float32)}
    model = (lambda rng, x: params, lambda p, x: (x @ p["w"]) @ (x @ p["w"]).T)
    with pytest.raises(ValueError, match=r"output has per-example shapes \(3,\), \(4,\) in batc"):
        predict(model, params, X, batch_size=4)  # 23 examples: a last batch of 3
    joined = predict(model, params, X[:20], batch_size=4)
    assert joined.shape == (20, 4)


def test_an_output_whose_first_axis_only_matches_the_batch_size_is_refused():
    """An ensemble's (members, B, C) of 8 members in batches of 8 passed the one-row-per-
    example check and came back as member-major pieces of the wrong rows."""
    params = {"w": np.ones((5, 2), np.float32)}
    ensemble = (lambda rng, x: params, lambda p, x: jax.numpy.stack([x @ p["w"]] * 8))
    with pytest.raises(ValueError, match=r"shape \(8, 8, 2\) for a batch of 8 examples and"):
        predict(ensemble, params, X[:16], batch_size=8)


class _Derived(_Scaled):
    @functools.cached_property
    def n_params(self):
        return 10


def test_a_new_loop_derived_from_a_validated_one_validates_the_changed_object():
    """A loop derived after a change (its own programs) was refused by the validation it
    shared with the old loop, after an epoch of training; reading a cached_property
    between runs was a change."""
    model = _Derived()
    data = [(X[:8], np.zeros((8, 2), np.float32))]
    base = fl.trainer(model, "mean_squared_error", "sgd").validate(model, data)
    base.run(data)
    assert model.n_params == 10
    assert base.run(data).status == "completed"  # a value derived on reading: no change
    model.scale = 10.0
    derived = base.metric("mean_absolute_error")
    fresh = fl.trainer(model, "mean_squared_error", "sgd").validate(model, data)
    fresh = fresh.metric("mean_absolute_error").run(data)
    assert derived.run(data).history == fresh.history


def test_batches_of_two_inputs_read_as_pairs_are_said_so_whatever_fails_after():
    # A model of two inputs, x = (users, items), reading them by index: given batches of
    # (users, items) tuples, predict reads each as (x, y) and the model gets users alone,
    # applies, and fails at its outputs; the note says how the batches were read.
    def apply(params, x):
        return jnp.sum(x[0] * params["w"]) + x[1]  # x[0] of users: a row; x[1]: one user

    model = fl.models.from_functions(lambda key, x: {"w": jnp.ones(())}, apply)
    users, items = np.arange(8, dtype=np.float32), np.ones(8, np.float32)
    batches = [(users[:4], items[:4]), (users[4:], items[4:])]
    with pytest.raises(ValueError) as refused:
        fl.predict(model, {"w": jnp.ones(())}, batches)
    notes = " ".join(getattr(refused.value, "__notes__", []))
    assert "read as (x, y): only its first item went to the model" in notes
    assert "pass them as a tuple (a, b)" not in str(refused.value) + notes
    # Batches of ((users, items), None) are x alone: the pair note would advise them.
    summed = fl.models.from_functions(
        lambda key, x: {"w": jnp.ones(())}, lambda params, x: jnp.sum(x[0] * params["w"])
    )
    with pytest.raises(ValueError) as refused:
        fl.predict(summed, {"w": jnp.ones(())}, [((users, items), None)])
    assert "read as (x, y)" not in " ".join(getattr(refused.value, "__notes__", []))


def test_one_example_without_its_batch_axis_is_told_to_add_it():
    """A flattening model's one window (T, F): its variables fit x[None], not x."""
    windows = RNG.normal(size=(16, 4, 2)).astype(np.float32)
    model = fl.models.mlp([8, 2])  # flattens each example's (4, 2) into 8 features
    trained = fl.trainer(model, "mse", "sgd").run([(windows, windows[:, 0])])
    with pytest.raises(ValueError, match=r"x of shape \(4, 2\).*one example.*x\[None\]"):
        fl.predict(model, trained, windows[0])
    assert fl.predict(model, trained, windows[0][None]).shape == (1, 2)
    # Its variables fit neither x nor x[None]: the error stays the one about the variables.
    with pytest.raises(ValueError, match="shaped unlike the data") as caught:
        fl.predict(model, trained, windows[:, :3])
    assert "x[None]" not in str(caught.value)


def test_an_output_without_a_row_per_example_names_the_batch_axis_and_stacking():
    from fuseloop._predict_outputs import require_rows

    with pytest.raises(ValueError, match=r"one example, add the batch's axis: x\[None\]"):
        require_rows(jnp.zeros(2), 8)
    with pytest.raises(ValueError, match=r"np\.stack\(examples\)"):
        require_rows(jnp.zeros(2), 8, listed=True)
