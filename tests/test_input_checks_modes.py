"""The same bad input is rejected fused and unfused, with the same class and message."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import make_batches
from fuseloop._checks import Checker

DATA = make_batches(6)
SPARSE = "sparse_categorical_cross_entropy"


def errors_in_both_modes(data, loss=SPARSE):
    """(class, message) of the error each mode raises."""
    found = []
    for fuse in (False, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(Exception) as info:
                fl.trainer(fl.models.mlp([4, 3]), loss, "sgd").run(data, fuse=fuse)
        found.append((type(info.value), str(info.value)))
    assert found[0] == found[1]
    return found[0]


def test_x_y_size_mismatch_in_a_later_batch():
    bad = list(DATA)
    bad[4] = (bad[4][0], bad[4][1][:3])
    kind, message = errors_in_both_modes(bad)
    assert kind is ValueError
    assert "iteration 4" in message and "x holds 4 examples but y holds 3" in message
    assert "ragged" not in message


def test_x_y_size_mismatch_gives_no_ragged_warning_unfused():
    bad = list(DATA)
    bad[4] = (bad[4][0], bad[4][1][:3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="x holds 4 examples but y holds 3"):
            fl.trainer(fl.models.mlp([4, 3]), SPARSE, "sgd").run(bad)


def test_a_short_first_batch_is_named_as_the_one_that_set_the_batch_size():
    short = [(DATA[0][0][:2], DATA[0][1][:2]), *DATA[1:3]]
    with pytest.warns(UserWarning, match=r"batch size 4 instead of 2 \(the run's first batch"):
        fl.trainer(fl.models.mlp([4, 3]), SPARSE, "sgd").run(short, fuse=False)
    with pytest.warns(UserWarning, match=r"batch size 2 instead of 4 \(a ragged last batch\?\)"):
        fl.trainer(fl.models.mlp([4, 3]), SPARSE, "sgd").run([*DATA[:2], short[0]], fuse=False)


def test_float_labels_for_sparse_cross_entropy():
    kind, message = errors_in_both_modes([(x, y.astype(np.float32)) for x, y in DATA])
    assert kind is ValueError
    assert "integer class labels" in message and "float32" in message


def test_whole_arrays_passed_as_a_pair():
    x = np.concatenate([x for x, _ in DATA])
    y = np.concatenate([y for _, y in DATA])
    kind, message = errors_in_both_modes((x, y))
    assert kind is ValueError
    assert "fl.data.arrays(x, y, batch_size=...)" in message
    # A dict of them is iterated over its keys: its first "batch" was the string 'x'.
    kind, message = errors_in_both_modes({"x": x, "y": y})
    assert kind is ValueError
    assert "iterated over its keys ('x', 'y'): for whole arrays" in message


def test_whole_arrays_of_a_two_input_model_passed_as_a_pair():
    # Keras's ((image, meta), y): its first batch is a pair too, read as x=image, y=meta
    # (refused before any model sees it, so the model does not matter).
    x, y = np.concatenate([x for x, _ in DATA]), np.concatenate([y for _, y in DATA])
    whole = r"reads as a pair \(x, y\), but the item after it is an array of shape \(24,\).*\(x may"
    loop = fl.trainer(fl.models.mlp([4, 3]), SPARSE, "sgd")
    with pytest.raises(ValueError, match=whole):
        loop.run(((x, x), y))
    with pytest.raises(ValueError, match=whole):
        loop.validate(fl.models.mlp([4, 3]), ((x, x), y))
    # A dict of inputs is no pair: the usual refusal, with the same hint.
    with pytest.raises(ValueError, match=r"first batch is a dict.*\(x may be a tuple or dict"):
        loop.run(({"image": x, "meta": x}, y))


@pytest.mark.parametrize(
    "batch", [([0.1, 0.2, 0.3], [0, 1, 2]), ([[0.1, 0.2, 0.3]] * 4, [0, 1, 2, 1])]
)
def test_python_lists_of_numbers_one_message(batch):
    kind, message = errors_in_both_modes([batch] * 4)
    assert kind is ValueError
    assert "Python list of" in message and "numbers" in message
    assert "x[0]" not in message  # one message, not one per number


def _resident_with_bad_label():
    x = np.concatenate([x for x, _ in DATA])
    y = np.concatenate([y for _, y in DATA])
    y[17] = 5
    return fl.data.arrays(x, y, batch_size=4, device=True)


def test_checker_rejects_a_bad_label_in_a_whole_dataset():
    loop = fl.trainer(fl.models.mlp([4, 3]), SPARSE, "sgd")
    source = _resident_with_bad_label()
    checker = Checker(loop.program)
    checker.first(next(iter(source)))
    with pytest.raises(ValueError, match="the dataset .*label 5, out of range"):
        checker.dataset(source)


def test_a_negative_label_is_named_with_its_own_fix():
    x = np.concatenate([x for x, _ in DATA])
    y = np.concatenate([y for _, y in DATA])
    y[3] = -1
    loop = fl.trainer(fl.models.mlp([4, 3]), SPARSE, "sgd")
    with pytest.raises(ValueError, match=r"label -1, out of range.*negative one") as caught:
        loop.run(fl.data.arrays(x, y, batch_size=4))
    assert "units" not in str(caught.value)  # no layer width fixes a negative label


def test_labels_out_of_range_on_device_resident_data():
    kind, message = errors_in_both_modes(_resident_with_bad_label())
    assert kind is ValueError and "label 5, out of range" in message


@pytest.mark.parametrize("loss, bad", [(SPARSE, 3), ("binary_cross_entropy", -1.0)])
def test_labels_given_as_jax_arrays_are_checked_in_both_modes(loss, bad):
    """A fused run reads jax labels as it stacks them; an unfused one must not train on
    the labels the fused one refuses (it once finished with a nan loss, or trained on -1)."""
    binary = loss != SPARSE  # then one 0/1 target per output (multi-label)
    labels = [np.eye(3, dtype=np.float32)[y] if binary else y.copy() for _, y in DATA]
    labels[2][1, ...] = bad
    data = [(jnp.asarray(x), jnp.asarray(y)) for (x, _), y in zip(DATA, labels, strict=True)]
    kind, message = errors_in_both_modes(data, loss)
    assert kind is ValueError and "iteration 2" in message and "out of range" in message
