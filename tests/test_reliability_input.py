"""Bad input gets a clear error: what was wrong, where (epoch, iteration, argument or leaf),
and how to fix it - raised before anything compiles where it can be (docs/reliability.md)."""

from __future__ import annotations

import functools
import itertools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import BATCH, CLASSES, FEATURES, counter_init, counter_loop, make_batches, tiny_mlp

SPARSE = "sparse_categorical_cross_entropy"


def sparse_trainer(model: Any = None) -> fl.Loop:
    return fl.trainer(tiny_mlp() if model is None else model, SPARSE, optax.sgd(0.1))


def linear_model(features: int = FEATURES, outputs: int = CLASSES) -> Any:
    """A plain (init, apply) model with a fixed input width: x must have `features`."""
    return fl.models.from_functions(
        lambda rng, x: {"w": jnp.ones((features, outputs), jnp.float32)},
        lambda p, x: x @ p["w"],
    )


def traced_loop(counter: list[int]) -> fl.Loop:
    """A custom loop whose step counts its traces: 0 means nothing compiled."""

    def step(batch: Any, s: Any) -> Any:
        counter[0] += 1
        return {"n": s["n"] + 1}

    return fl.loop(step)


@pytest.fixture(scope="module")
def loop() -> fl.Loop:
    return sparse_trainer()


# --------------------------------------------------------------------------- (x, y) pairs
@pytest.mark.parametrize(
    "bad",
    [
        lambda b: (b[0],),
        lambda b: (b[0], b[1], b[1]),
        lambda b: {"x": b[0], "y": b[1]},
        lambda b: b[0],
    ],
    ids=["one", "three", "dict", "array"],
)
@pytest.mark.parametrize("kind", ["trainer", "evaluator"])
def test_first_batch_not_a_pair(loop, kind, bad):
    data = [bad(b) for b in make_batches(2)]
    # x alone (a torch TensorDataset(x)'s items) is told the unlabelled form, (x, None)
    unlabelled = r"unlabelled data.*: \(x, None\), or fl\.data\.arrays\(x, None"
    with pytest.raises(ValueError, match=rf"first batch .*pair \(x, y\).*{unlabelled}.*fl\.loop"):
        if kind == "trainer":
            loop.run(data)
        else:
            params = jax.tree.map(np.zeros_like, loop.run(make_batches(1)).params)
            fl.evaluator(tiny_mlp()).run(data, params)


def test_keras_sample_weights_get_the_fix_the_message_names_and_it_trains():
    weighted = [(x, y, np.full(len(y), 2.0, np.float32)) for x, y in make_batches(4)]
    with pytest.raises(ValueError, match=r"sample_weight.*\{'y': y, 'weight': w\}.*mean\(\)"):
        sparse_trainer().run(weighted)

    def loss(y_true: Any, y_pred: Any) -> Any:
        each = optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true["y"])
        return (y_true["weight"] * each).mean()

    data = [(x, {"y": y, "weight": w}) for x, y, w in weighted]
    loop = fl.trainer(tiny_mlp(), loss, optax.sgd(0.0))
    plain = loop.run(data)
    assert loop.run(data, fuse=4).metrics == plain.metrics
    unweighted = fl.evaluator(tiny_mlp(), SPARSE).run(make_batches(4), plain.params)
    assert plain.metrics["loss"] == pytest.approx(2 * unweighted.metrics["loss"], rel=1e-6)


@pytest.mark.parametrize("fuse", [False, 2, 4])  # 4: in the chunk of the run's first batch
def test_later_batch_not_a_pair_names_epoch_and_iteration(loop, fuse):
    data = make_batches(4)
    data[3] = (data[3][0], data[3][1], data[3][1])
    with pytest.raises(ValueError, match=r"epoch 0, iteration 3 is a tuple of length 3.*pair"):
        loop.run(data, fuse=fuse)


@pytest.mark.parametrize("fuse", [False, 2])
@pytest.mark.parametrize(
    "batch",
    [
        (0, 0),
        {"a": np.ones(3, np.float32)},
        np.ones(3, np.float32),
        (np.ones(2, np.float32), np.ones(2, np.float32), np.ones(2, np.float32)),
    ],
    ids=["ints", "dict", "array", "triple"],
)
def test_custom_loops_take_any_batch(fuse, batch):
    counter = fl.loop(lambda b, s: {"n": s["n"] + 1})
    state = counter.run([batch] * 3, {"n": jnp.zeros((), jnp.int32)}, fuse=fuse)
    assert int(state.step_state["n"]) == 3


# --------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("fuse", [False, 2])
def test_later_x_of_another_shape_names_leaf_expected_and_actual(loop, fuse):
    data = make_batches(4)
    data[2] = (np.zeros((BATCH, FEATURES + 2), np.float32), data[2][1])
    with pytest.raises(ValueError) as info:
        loop.run(data, fuse=fuse)
    message = str(info.value)
    assert "epoch 0, iteration 2" in message and "leaf x " in message
    assert f"({BATCH}, {FEATURES + 2})" in message and f"({BATCH}, {FEATURES})" in message
    if fuse:
        assert isinstance(info.value, fl.FusionError)


def test_a_refused_batch_starts_no_iteration_at_any_chunk_size(loop):
    # The unfused loop fired iteration_started for the refused batch, a fused one did not.
    data = make_batches(7)
    data[5] = (np.zeros((BATCH, FEATURES + 2), np.float32), data[5][1])
    seen = {}
    for fuse in (False, 1, 4):
        started: list[int] = []
        watched = loop.handle_event(
            "iteration_started", lambda s, log=started: log.append(s.iteration)
        )
        with pytest.raises(ValueError, match="epoch 0, iteration 5") as info:
            watched.run(data, fuse=fuse)
        counts = info.value.fuseloop_state.event_counts
        seen[fuse] = (started, counts["iteration_started"], counts["iteration_completed"])
    assert seen[False] == seen[1] == seen[4] == ([0, 1, 2, 3, 4], *[{"total": 5, "epoch": 5}] * 2)


@pytest.mark.parametrize("fuse", [False, 2])
def test_a_per_batch_weight_first_given_as_an_int_is_told_to_be_a_float(fuse):
    # `1`, then `0.5`: the advice was to cast 0.5 to int32, which trains on 0 in silence.
    def loss(y_true, y_pred):
        return jnp.mean((y_pred[:, 0] - y_true["t"]) ** 2) * y_true["scale"]

    batches = [
        (x, {"t": y.astype(np.float32), "scale": s})
        for (x, y), s in zip(make_batches(4), (1, 0.5, 0.25, 1.0), strict=True)
    ]
    loop = fl.trainer(fl.models.mlp([4, 1]), loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"scale.*gave it as an integer.*float in every batch"):
        loop.run(batches, fuse=fuse)
    batches[1] = (batches[1][0], {**batches[1][1], "scale": jnp.bfloat16(0.5)})  # jnp's float
    with pytest.raises(ValueError, match=r"scale.*gave it as an integer.*float in every batch"):
        loop.run(batches, fuse=fuse)


def test_pytree_leaf_is_named_by_its_path():
    loop = fl.trainer(
        fl.models.from_functions(
            lambda rng, x: {"w": jnp.ones((FEATURES, CLASSES))},
            lambda p, x: x["image"] @ p["w"] + x["meta"].sum(),
        ),
        SPARSE,
        "sgd",
    )
    data = [({"image": x, "meta": np.zeros((BATCH, 2), np.float32)}, y) for x, y in make_batches(3)]
    data[1] = ({"image": data[1][0]["image"], "meta": np.zeros((BATCH, 5), np.float32)}, data[1][1])
    with pytest.raises(ValueError, match=r"leaf x\['meta'\] has shape \(4, 5\).*\(4, 2\)"):
        loop.run(data)


def test_later_y_of_another_dtype_is_named(loop):
    data = make_batches(3)
    data[1] = (data[1][0], data[1][1].astype(np.float32))
    with pytest.raises(ValueError, match=r"iteration 1: leaf y .*float32.*int32"):
        loop.run(data)


def test_x_that_does_not_fit_the_model_fails_before_compiling():
    data = [(np.zeros((BATCH, FEATURES + 1), np.float32), y) for _, y in make_batches(2)]
    with pytest.raises(ValueError, match=r"x does not fit the model.*x of shape \(4, 4\)"):
        fl.trainer(linear_model(), SPARSE, "sgd").run(data)


def test_x_that_does_not_fit_given_variables_is_named(loop):
    params = loop.run(make_batches(1)).params  # trained on FEATURES inputs
    data = [(np.zeros((BATCH, FEATURES + 1), np.float32), y) for _, y in make_batches(2)]
    with pytest.raises(ValueError, match=r"x does not fit the model.*given variables"):
        fl.evaluator(tiny_mlp()).run(data, params)


@pytest.mark.parametrize(
    "loss, y, pattern",
    [
        (SPARSE, np.zeros((BATCH, 2), np.int32), r"y has shape \(4, 2\).*labels of shape \(4,\)"),
        (
            "categorical_cross_entropy",
            np.zeros((BATCH,), np.float32),
            r"y has shape \(4,\).*same shape \(4, 3\)",
        ),
        (
            "mean_squared_error",
            np.zeros((BATCH, 2), np.float32),
            r"y has shape \(4, 2\).*one value per output, shape \(4, 3\)",
        ),
        (
            lambda y, p: jnp.mean((p - y) ** 2),
            np.zeros((BATCH, 2), np.float32),
            r"y does not fit the loss '<lambda>'.*y of shape \(4, 2\).*\(4, 3\)",
        ),
        (lambda y, p: (p - y) ** 2, np.zeros((BATCH, 3), np.float32), r"must return a scalar"),
    ],
    ids=["sparse", "categorical", "mse", "custom", "not-scalar"],
)
def test_y_that_does_not_fit_output_and_loss(loss, y, pattern):
    x = make_batches(1)[0][0]
    with pytest.raises(ValueError, match=pattern):
        fl.trainer(tiny_mlp(), loss, "sgd").run([(x, y)])


def test_column_labels_are_accepted(loop):
    data = [(x, y[:, None]) for x, y in make_batches(2)]
    assert loop.run(data).status == "completed"


# --------------------------------------------------------------------------- labels
def test_label_out_of_range_in_first_batch():
    data = make_batches(2)
    data[0] = (data[0][0], np.full((BATCH,), CLASSES + 2, np.int32))
    with pytest.raises(
        ValueError, match=rf"first batch: y holds the label {CLASSES + 2}.*{CLASSES} classes"
    ) as raised:
        sparse_trainer().run(data)
    assert "ignore" not in str(raised.value)
    # 255, segmentation's ignore index, is told the masking loss beside more units.
    data[0] = (data[0][0], np.array([0, 255, 1, 255], np.uint8))
    with pytest.raises(ValueError, match=r"label 255.*255 marks pixels to ignore.*mask"):
        sparse_trainer().run(data)


@pytest.mark.parametrize("fuse", [False, 3])
def test_negative_label_in_a_later_batch_names_epoch_and_iteration(loop, fuse):
    data = make_batches(5)
    data[4] = (data[4][0], np.array([0, -1, 1, 0], np.int32))
    with pytest.raises(
        ValueError, match=r"epoch 0, iteration 4: y holds the label -1.*-100 need a loss"
    ):
        loop.run(data, fuse=fuse)


def test_a_negative_label_already_on_the_device_is_refused_in_every_mode(loop):
    """Labels given as jax arrays are read as numpy labels are: a label of -1 (or -100, the
    padding of a Hugging Face collator) must neither wrap to the last class nor train to a
    nan loss, in training or validation data, fused or not."""
    data = make_batches(3)
    labels = [y.copy() for _, y in data]
    labels[1][1] = -1  # set on the host, then moved: no eager scatter on the device
    on_device = [(jnp.asarray(x), jnp.asarray(y)) for (x, _), y in zip(data, labels, strict=True)]
    for fuse in (False, 3):
        with pytest.raises(ValueError, match=r"iteration 1: y holds the label -1, out of range"):
            loop.run(on_device, fuse=fuse)
        with pytest.raises(ValueError, match=r"label -1, out of range(.|\n)*validate\(\)'s data"):
            loop.validate(tiny_mlp(), on_device).run(data, fuse=fuse)


@pytest.mark.parametrize("device", [False, True])
def test_a_negative_int8_label_of_a_model_of_many_classes_is_refused(device):
    # int8 -1 read as unsigned is 255, which is a class of a 300-class model.
    data = make_batches(2)
    x = np.concatenate([b[0] for b in data])
    y = np.zeros(len(x), np.int8)
    y[5] = -1
    loop = fl.trainer(fl.models.mlp([300]), SPARSE, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"y holds the label -1, out of range .* 300 classes"):
        loop.run(fl.data.arrays(x, y, BATCH, shuffle=False, device=device))


def _binary_batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [
        (rng.normal(size=(BATCH, FEATURES)).astype(np.float32), rng.uniform(size=(BATCH, 1)))
        for _ in range(n)
    ]


@functools.cache
def _binary_trainer() -> fl.Loop:
    """One Loop for the binary tests: a new one traces and lowers its programs again."""
    return fl.trainer(fl.models.mlp([4, 1]), "binary_cross_entropy", optax.sgd(0.1))


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_binary_target_out_of_zero_one_is_named_where_it_is(fuse):
    data = [(x, y.astype(np.float32)) for x, y in _binary_batches(5)]
    # Probabilities between 0 and 1 (soft targets) train.
    assert _binary_trainer().run(data, fuse=fuse).status == "completed"
    data[4] = (data[4][0], np.array([[0.0], [2.0], [1.0], [0.0]], np.float32))
    with pytest.raises(ValueError, match=r"epoch 0, iteration 4: y holds the target 2.0.*\[0, 1\]"):
        _binary_trainer().run(data, fuse=fuse)


@pytest.mark.parametrize("device", [False, True])
def test_bfloat16_binary_targets_are_numbers_and_range_checked(device):
    x = np.concatenate([b[0] for b in _binary_batches(4)])
    y = (x[:, :1] > 0).astype(jnp.bfloat16)
    state = _binary_trainer().run(fl.data.arrays(x, y, BATCH, device=device), fuse=2)
    assert state.status == "completed"
    with pytest.raises(ValueError, match=r"target 2.0, out of range"):
        _binary_trainer().run(fl.data.arrays(x, y * 2, BATCH, device=device), fuse=2)


@pytest.mark.parametrize("device", [False, True])
def test_labels_of_minus_one_and_one_for_a_binary_loss_are_refused(device):
    x = np.concatenate([b[0] for b in _binary_batches(4)])
    y = np.where(x[:, :1] > 0, 1.0, -1.0).astype(np.float32)
    data = fl.data.arrays(x, y, BATCH, device=device)
    with pytest.raises(ValueError, match=r"target -1.0, out of range.*Map labels of -1/1"):
        _binary_trainer().run(data, fuse=2)
    # A sorted dataset's first batch may hold only -1: the same advice.
    order = np.argsort(y[:, 0], kind="stable")
    data = fl.data.arrays(x[order], y[order], BATCH, shuffle=False, device=device)
    with pytest.raises(ValueError, match=r"target -1.0, out of range.*Map labels of -1/1"):
        _binary_trainer().run(data, fuse=2)


# --------------------------------------------------------------------------- dtypes
def test_float64_input_warns_once_and_trains_as_float32(loop):
    data32 = make_batches(3)
    data64 = [(x.astype(np.float64), y) for x, y in data32]
    with pytest.warns(UserWarning, match=r"leaf x is float64.*astype\(np\.float32\)") as caught:
        state64 = loop.run(data64, epochs=2)
    assert sum("is float64" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*float64.*")
        state32 = loop.run(data32, epochs=2)
    for a, b in zip(jax.tree.leaves(state64.params), jax.tree.leaves(state32.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_float64_warning_names_every_float64_leaf():
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(8, 2)), "b": rng.normal(size=(8, 2)).astype(np.float32)}
    x["c"] = rng.normal(size=(8, 1))
    data = [(x, rng.normal(size=(8, 1)))]
    model = fl.models.mlp([1])

    def apply(variables, xb):
        return model.apply(variables, jax.numpy.concatenate([xb["a"], xb["b"], xb["c"]], -1))

    def init(key, xb):
        return model.init(key, np.zeros((1, 5), np.float32))

    loop = fl.trainer((init, apply), "mean_squared_error", optax.sgd(0.1))
    with pytest.warns(UserWarning, match=r"leaves x\['a'\], x\['c'\], y are float64") as got:
        loop.run(data)
    assert sum("float64" in str(w.message) for w in got) == 1


@pytest.mark.parametrize("fuse", [2, 4])
def test_mixed_dtypes_in_a_fused_chunk_raise_fusion_error(loop, fuse):
    data = make_batches(4)
    data[1] = (data[1][0], data[1][1].astype(np.int16))
    with pytest.raises(
        fl.FusionError, match=r"iteration 1: leaf y .*int16.*int32.*cast it to int32"
    ):
        loop.run(data, fuse=fuse)


@pytest.mark.parametrize("fuse", [False, 1, 2])
def test_float64_among_float32_batches(loop, fuse):
    data = make_batches(4)
    data[2] = (data[2][0].astype(np.float64), data[2][1])
    if not fuse:  # unfused, the step sees float32 either way: accepted, with the warning
        with pytest.warns(UserWarning, match="leaf x is float64"):
            assert loop.run(data).status == "completed"
        return
    with pytest.raises(fl.FusionError, match=r"iteration 2: leaf x .*float64.*float32"):
        loop.run(data, fuse=fuse)


# --------------------------------------------------------------------------- ragged batches
def test_ragged_last_batch_unfused_compiles_once_more_and_warns_once():
    loop = sparse_trainer()
    data = make_batches(3)
    x, y = make_batches(1, seed=1)[0]
    data.append((x[:2], y[:2]))
    with pytest.warns(UserWarning, match=r"iteration 3 has batch size 2 instead of 4") as caught:
        state = loop.run(data, epochs=3)
    assert sum("batch size" in str(w.message) for w in caught) == 1
    assert state.stats["compiles"] == 2
    assert state.event_counts["iteration_completed"]["total"] == 12
    with pytest.warns(UserWarning, match="batch size 2"):
        assert loop.run(data).stats["compiles"] == 0


def test_second_short_batch_size_raises(loop):
    data = make_batches(4)
    data[1] = (data[1][0][:3], data[1][1][:3])
    data[3] = (data[3][0][:2], data[3][1][:2])
    with (
        pytest.warns(UserWarning, match="batch size 3"),
        pytest.raises(ValueError, match=r"iteration 3 has batch size 2.*only one short batch size"),
    ):
        loop.run(data)


def test_leaves_with_different_batch_sizes_raise(loop):
    data = make_batches(2)
    data[1] = (data[1][0][:2], data[1][1][:3])
    with pytest.raises(ValueError, match="x holds 2 examples but y holds 3"):
        loop.run(data)


@pytest.mark.parametrize("fuse", [1, 3])
def test_ragged_last_batch_fused_raises_fusion_error(loop, fuse):
    data = make_batches(3)
    data.append((data[0][0][:2], data[0][1][:2]))
    with pytest.raises(
        fl.FusionError,
        match=r"iteration 3: leaf x has shape \(2, 3\).*"
        r"drop_remainder=True",
    ) as raised:
        loop.run(data, fuse=fuse)
    # A list shows its last batch: refused before the epoch's first step, not after it.
    assert raised.value.fuseloop_state.stats["dispatches"] == 0


@pytest.mark.parametrize("container", [list, tuple, lambda b: lambda: iter(b)])
def test_short_last_batch_of_a_sequence_is_refused_before_the_first_step(container):
    """A list's or tuple's short last batch is known up front; a callable's only when it
    comes, after the chunks before it stepped; a bound short of it never reaches it."""
    batches = make_batches(5)
    batches.append((batches[0][0][:2], batches[0][1][:2]))
    data = container(batches)
    with pytest.raises(
        fl.FusionError, match=r"iteration 5: leaf batch\[0\] has shape \(2, 3\)"
    ) as raised:
        traced_loop([0]).run(data, {"n": 0}, fuse=2)
    dispatches = raised.value.fuseloop_state.stats["dispatches"]
    assert dispatches == (0 if isinstance(data, (list, tuple)) else 3)
    state = traced_loop([0]).run(data, {"n": 0}, fuse=2, iterations=5, epochs=2)
    assert int(state.step_state["n"]) == 10
    # A short first batch is the reference: the full ones after it are refused where they
    # come, after the steps before them, as the unfused loop meets them.
    data = container(batches[-1:] + batches[:-1])
    with pytest.raises(fl.FusionError, match=r"iteration 1: leaf batch\[0\]") as raised:
        traced_loop([0]).run(data, {"n": 0}, fuse=2)
    assert raised.value.fuseloop_state.stats["dispatches"] == 1
    # A batch between them that differs is refused first, where it comes.
    data = container([batches[0], (batches[1][0][:3], batches[1][1][:3]), *batches[2:]])
    with pytest.raises(fl.FusionError, match=r"iteration 1: leaf batch\[0\]"):
        traced_loop([0]).run(data, {"n": 0}, fuse=2)
    # An iteration handler may halt the epoch before the short batch: it runs as unfused.
    halting = traced_loop([0]).handle_event(
        "iteration_completed", lambda s: "halt_loop" if s.iteration >= 3 else None
    )
    for fuse in (False, 1, 2):
        state = halting.run(container(batches), {"n": 0}, fuse=fuse)
        assert (state.status, int(state.step_state["n"])) == ("halted", 4), fuse
    # An observer (as `log=` attaches) cannot halt: the list's is refused up front still.
    observed = traced_loop([0]).observe("iteration_completed", lambda s: None)
    with pytest.raises(fl.FusionError, match="iteration 5") as raised:
        observed.run(container(batches), {"n": 0}, fuse=2)
    up_front = isinstance(container(batches), (list, tuple))
    assert raised.value.fuseloop_state.stats["dispatches"] == (0 if up_front else 3)


# --------------------------------------------------------------------------- empty data
@pytest.mark.parametrize(
    "data", [[], (), lambda: iter([]), iter([])], ids=["list", "tuple", "callable", "iterator"]
)
@pytest.mark.parametrize("fuse", [False, 4])
def test_empty_data_raises_before_compiling(data, fuse):
    traces = [0]
    with pytest.raises(ValueError, match=r"data is empty.*at least one"):
        traced_loop(traces).run(data, {"n": 0}, fuse=fuse)
    assert traces[0] == 0


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"epochs": 0}, "epochs"),
        ({"epochs": -2}, "epochs"),
        ({"epochs": 1.5}, "epochs"),
        ({"epochs": True}, "epochs"),
        ({"epochs": "3"}, "epochs"),
        ({"iterations": 0}, "iterations"),
        ({"fuse": 0}, "fuse"),
        ({"fuse": -4}, "fuse"),
        ({"fuse": 2.0}, "fuse"),
        ({"fuse": "fast"}, "fuse"),
        ({"fuse": True, "jit": False}, "fuse"),
        ({"jit": "yes"}, "jit"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"mesh": "cpu"}, "mesh"),
    ],
)
def test_invalid_run_arguments_name_the_argument(kwargs, argument):
    traces = [0]
    with pytest.raises(ValueError, match=rf"{argument}="):
        traced_loop(traces).run([(0, 0)], {"n": 0}, **kwargs)
    assert traces[0] == 0


@pytest.mark.parametrize("data", [5, "abc", None, 3.0])
def test_data_that_is_not_a_source(data):
    with pytest.raises(ValueError, match=r"data=.*not a data source.*list of \(x, y\)"):
        traced_loop([0]).run(data, {"n": 0})


@pytest.mark.parametrize(
    "build, argument",
    [
        (lambda: fl.trainer(5, SPARSE, "sgd"), "model"),
        (lambda: fl.trainer(tiny_mlp(), "hinge", "sgd"), "loss"),
        (lambda: fl.trainer(tiny_mlp(), 3, "sgd"), "loss"),
        (lambda: fl.trainer(tiny_mlp(), SPARSE, "rmsprop"), "optimizer"),
        (lambda: fl.trainer(tiny_mlp(), SPARSE, 0.1), "optimizer"),
        (lambda: fl.trainer(tiny_mlp(), SPARSE, "sgd", log=-1), "log"),
        (lambda: fl.trainer(tiny_mlp(), SPARSE, "sgd", seed="a"), "seed"),
        (lambda: fl.evaluator("model"), "model"),
        (lambda: fl.loop(5), "step_fn"),
        (lambda: fl.loop(lambda b, s: s, init_fn=3), "init_fn"),
        (lambda: sparse_trainer().handle_event("epoch_done", print), "event"),
        (lambda: sparse_trainer().handle_event("started", 5), "handler"),
        (lambda: sparse_trainer().handle_event("started", print, "sometimes"), "filter"),
        (lambda: sparse_trainer().handle_event("started", print, {"evry": 2}), "filter"),
        (lambda: sparse_trainer().handle_event("started", print, {"every": 0}), "filter"),
        (lambda: sparse_trainer().metric("f1"), "metric"),
        (lambda: sparse_trainer().metric("accuracy", accumulate="max"), "accumulate"),
        (lambda: sparse_trainer().metric("accuracy").metric("accuracy"), "metric name"),
        (lambda: fl.models.mlp([]), "features"),
        (lambda: fl.models.mlp([4], activation="swish2"), "activation"),
    ],
)
def test_invalid_builder_arguments_name_the_argument(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()


def test_handler_returning_garbage_is_named(loop):
    bad = loop.handle_event("epoch_completed", lambda s: 42, name="answer")
    with pytest.raises(ValueError, match=r"handler answer returned int.*None, a status"):
        bad.run(make_batches(2))
    with pytest.raises(ValueError, match=r"handler answer returned status 'stop'.*halt_loop"):
        loop.handle_event("epoch_completed", lambda s: "stop", name="answer").run(make_batches(2))
    swapped = loop.handle_event("epoch_completed", lambda s: (None, s), name="answer")
    with pytest.raises(ValueError, match=r"a pair whose first item is None, not a status"):
        swapped.run(make_batches(2))


def test_home_and_relative_paths_save_and_load_as_in_a_shell(loop, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    state = loop.checkpoint("~/runs").run(make_batches(2))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["checkpoint_000001_epoch_0"]
    assert not (tmp_path / "~").exists()
    fl.save_state(state, "~/state")
    assert fl.load_state("~/state").epoch == state.epoch
    # Relative paths, from the working directory, as save_state and checkpoint take them.
    fl.save_state(state, "relative_state")
    assert fl.load_state("relative_state").epoch == fl.load_state("runs").epoch == state.epoch


@pytest.mark.parametrize("fuse", [False, 2])
def test_warnings_point_at_the_callers_line_so_each_calling_line_sees_them(loop, fuse):
    data = make_batches(4)
    ragged = [*data[:3], (data[3][0][:3], data[3][1][:3])]
    wide = [(x.astype(np.float64), y) for x, y in data]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.run(ragged)  # a ragged batch is refused in a fused chunk
        loop.run(wide, fuse=fuse)
        loop.run(iter(data), epochs=2, fuse=fuse)
        loop.run(data, state, epochs=1, fuse=fuse)
        loop.validate(tiny_mlp(), fl.data.arrays(*data[0], batch_size=3))
    assert len(caught) == 5, [str(w.message) for w in caught]
    assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]


@pytest.mark.parametrize("fuse", [False, 2])
def test_sequences_padded_to_each_batchs_longest_are_told_to_pad_to_one_length(fuse):
    def model_init(rng, x):
        return {"embed": jax.random.normal(rng, (8, 3))}

    def apply(params, x):  # (B, T) tokens -> (B, 3) logits, any T
        return params["embed"][x].mean(axis=1)

    # A dynamic-padding collator: every batch padded to its own longest sequence.
    data = [(np.zeros((4, t), np.int32), np.zeros(4, np.int32)) for t in (5, 7, 5)]
    loop = fl.trainer(fl.models.from_functions(model_init, apply), SPARSE, "sgd")
    with pytest.raises(ValueError, match=r"shape \(4, 7\).*pad sequences to one length"):
        loop.run(data, fuse=fuse)


class _Buckets(nn.Module):
    """Hashed feature ids, bucketed on the device: ids beyond int32 would wrap first."""

    @nn.compact
    def __call__(self, ids: Any) -> Any:
        return nn.Embed(10, 3)(ids[:, 0] % 10)


@functools.cache
def _buckets_trainer() -> fl.Loop:
    """One _Buckets trainer for the int64 tests (not the x64 one): a new Loop traces again."""
    return fl.trainer(_Buckets(), "sparse_categorical_cross_entropy", "sgd")


def _ids(wide_at: int | None) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(24, dtype=np.int64)[:, None]  # int64, in int32's range
    if wide_at is not None:
        ids[wide_at] = 2**33 + 7  # narrowed to int32 on the device: 7
    return ids, (np.arange(24) % 3).astype(np.int64)


@pytest.mark.parametrize("fuse", [False, 4])
@pytest.mark.parametrize("source", ["list", "arrays", "resident"])
def test_int64_values_beyond_32_bits_are_refused_not_wrapped(source, fuse):
    loop = _buckets_trainer()

    def data(wide_at: int | None) -> Any:
        ids, y = _ids(wide_at)
        if source == "list":
            return [(ids[i : i + 4], y[i : i + 4]) for i in range(0, 24, 4)]
        return fl.data.arrays(ids, y, 4, shuffle=False, device=source == "resident")

    loop.run(data(None), epochs=1, fuse=fuse)  # int64 ids and labels in range: fine
    with pytest.raises(ValueError, match=r"x holds int64 values beyond int32's range.*8589934599"):
        loop.run(data(13), epochs=1, fuse=fuse)  # in a later batch than the first


@pytest.mark.parametrize("fuse", [False, 4])
def test_an_int64_leaf_after_an_int32_first_batch_is_read_too(fuse):
    # One file's ids inferred as int32, a later one's as int64: the later values would
    # wrap as silently (unfused), and a fused run's fix is a cast, which would wrap them.
    ids, y = _ids(13 if fuse is False else 5)  # a fused chunk's first int64 batch: 1
    batches = [(ids[i : i + 4], y[i : i + 4].astype(np.int32)) for i in range(0, 24, 4)]
    batches[0] = (batches[0][0].astype(np.int32), batches[0][1])
    at = 3 if fuse is False else 1
    beyond = rf"epoch 0, iteration {at}: x holds int64 values beyond int32's range.*8589934599"
    with pytest.raises(ValueError, match=beyond):
        _buckets_trainer().run(batches, fuse=fuse)
    # Zeros of the variables' shapes (the data check raises first): no eager init.
    shapes = jax.eval_shape(lambda x: _Buckets().init(jax.random.PRNGKey(0), x), ids[:4])
    variables = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
    with pytest.raises(ValueError, match=beyond):
        fl.evaluator(_Buckets(), "sparse_categorical_cross_entropy").run(batches, variables)
    batches[at] = (_ids(None)[0][4 * at : 4 * at + 4], batches[at][1])  # now in range
    loop = _buckets_trainer()
    if fuse is False:
        loop.run(batches, fuse=fuse)  # the unfused run converts it
    else:  # the fix is a cast, which would wrap values beyond int32: the message says so
        with pytest.raises(fl.FusionError, match=r"astype\('int32'\)\), where values beyond"):
            loop.run(batches, fuse=fuse)


@functools.cache
def _wide_trainer() -> fl.Loop:
    return fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "sgd")


@pytest.mark.parametrize("leaf", ["x", "y"])
def test_a_big_endian_array_is_refused_with_the_conversion_and_arrays_converts_it(leaf):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = (np.arange(16) % 3).astype(np.int32)
    swapped = {"x": x, "y": y}[leaf].astype({"x": ">f4", "y": ">i4"}[leaf])
    batch = (swapped, y) if leaf == "x" else (x, swapped)
    loop = _wide_trainer()
    with pytest.raises(ValueError, match=rf"{leaf} is a big-endian array.*{leaf}\.astype\("):
        loop.run([batch])
    # fl.data.arrays copies its arrays anyway, into the machine's byte order: same values.
    native = loop.run(fl.data.arrays(x, y, 16, shuffle=False, device=True))
    converted = loop.run(fl.data.arrays(*batch, 16, shuffle=False, device=True))
    assert native.history == converted.history


def test_a_dataset_used_under_x64_is_still_checked_once_x64_is_off():
    # Under x64 nothing is narrowed and nothing is read: the dataset is not vouched for.
    ids, y = _ids(13)
    data = fl.data.arrays(ids, y, 4, shuffle=False)
    loop = fl.trainer(_Buckets(), "sparse_categorical_cross_entropy", "sgd")
    with jax.enable_x64(True):
        loop.run(data, epochs=1)
    with pytest.raises(ValueError, match=r"x holds int64 values beyond int32's range"):
        loop.run(data, epochs=1, fuse=4)


def test_a_used_up_iterator_run_again_is_named_as_one():
    # A notebook cell run twice over the same generator: the advice was batch_size's.
    batches = iter(make_batches(2))
    loop = counter_loop()
    loop.run(batches, counter_init())
    with pytest.raises(ValueError, match=r"one-shot iterator .* is spent: it ran out"):
        loop.run(batches, counter_init())
    # An endless generator the first run closed was told it was "already used up".
    endless = itertools.cycle(make_batches(2))
    generator = (batch for batch in endless)
    loop.run(generator, counter_init(), iterations=3)
    with pytest.raises(ValueError, match=r"or an earlier run closed it .* endless generator"):
        loop.run(generator, counter_init(), iterations=3)


def test_typed_prng_keys_as_data_are_refused_naming_their_raw_form():
    """A batch leaf of `jax.random.key`s met numpy's "Cannot interpret 'key<fry>' as a data
    type" (host batches) or jax's own TypeError (fl.data.arrays, fl.predict)."""
    keys = jax.random.split(jax.random.key(0), 8)
    x = np.ones((8, FEATURES), np.float32)
    y = np.zeros(8, np.int32)
    fix = r"\['key'\] holds typed PRNG keys .* jax\.random\.key_data\(keys\)"
    batches = [({"x": x, "key": keys}, y)]

    def step(batch: Any, s: Any) -> Any:
        keys = jax.random.wrap_key_data(batch[0]["key"])
        return {"n": s["n"] + 1, "u": s["u"] + jax.vmap(jax.random.uniform)(keys).sum()}

    init = {"n": np.int32(0), "u": np.float32(0)}
    for fuse in (False, 2):
        with pytest.raises(ValueError, match=r"batch\[0\]" + fix):
            fl.loop(step).run(batches, init, fuse=fuse)
    for device in (False, True):
        with pytest.raises(ValueError, match="x" + fix):
            fl.data.arrays({"x": x, "key": keys}, y, batch_size=4, device=device)
    model = fl.models.from_functions(lambda rng, x: {}, lambda p, x: x["x"])
    with pytest.raises(ValueError, match="x" + fix):
        fl.trainer(model, SPARSE, "sgd").run(batches)
    with pytest.raises(ValueError, match=r"x holds typed PRNG keys"):
        fl.predict(model, {}, keys, batch_size=4)
    # Their raw data is a uint32 array like any other.
    raw = [({"x": x, "key": jax.random.key_data(keys)}, y)] * 3
    unfused, fused = (fl.loop(step).run(raw, init, fuse=f).step_state for f in (False, 2))
    assert int(fused["n"]) == 3 and float(fused["u"]) == float(unfused["u"]) > 0


@pytest.mark.parametrize("device", [False, True])
def test_a_missing_binary_target_is_named_as_missing_with_its_index(device):
    x = np.concatenate([b[0] for b in _binary_batches(4)])
    y = (x[:, :1] > 0).astype(np.float32)
    y[5, 0] = np.nan  # a missing label, as a left join leaves it
    data = fl.data.arrays(x, y, BATCH, device=device)
    with pytest.raises(ValueError, match=r"target nan, .*index \(5, 0\)\. A NaN target is a miss"):
        _binary_trainer().run(data, fuse=2)


def test_binary_labels_of_two_other_classes_are_told_how_to_map_them():
    x = np.concatenate([b[0] for b in _binary_batches(4)])
    y = (x[:, :1] > 0).astype(np.float32) + 1.0  # classes 1 and 2
    with pytest.raises(ValueError, match=r"Map the two classes' labels 1.0/2.0 to 0/1"):
        _binary_trainer().run(fl.data.arrays(x, y, BATCH), fuse=2)
    y[0] = 0.0  # three values: a third class, or a stray target
    with pytest.raises(ValueError, match=r"hold 3 distinct values \(0.0, 1.0, 2.0\): for more"):
        _binary_trainer().run(fl.data.arrays(x, y, BATCH), fuse=2)


def test_a_nan_label_cast_to_an_integer_is_named_as_a_missing_label():
    x = np.concatenate([b[0] for b in _binary_batches(4)])
    y = np.where(x[:, 0] > 0, 1.0, 2.0).astype(np.float32)
    y[3] = np.nan
    loop = fl.trainer(fl.models.mlp([4, 3]), "sparse_categorical_cross_entropy", optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"Cast them .* once NaN labels are dropped, or for one"):
        loop.run(fl.data.arrays(x, y, BATCH), fuse=2)
    one_hot = np.eye(3, dtype=np.float32)[np.nan_to_num(y).astype(np.int32)]
    with pytest.raises(ValueError, match=r"to a class: for one-hot targets use 'categorical_cr"):
        loop.run(fl.data.arrays(x, one_hot, BATCH), fuse=2)
    with np.errstate(invalid="ignore"):
        cast = y.astype(np.int32)  # what the advice would give without dropping the NaN
    with pytest.raises(ValueError, match=r"what a missing \(NaN\) float label becomes"):
        loop.run(fl.data.arrays(x, cast, BATCH), fuse=2)
