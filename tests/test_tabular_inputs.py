"""What a pandas / scikit-learn user hands fuseloop: data frames, sparse matrices, float
labels, a one-unit binary model under a multi-class loss."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import fuseloop as fl

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 3)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.float32)
MODEL = fl.models.mlp([4, 1])


@functools.cache
def _variables():
    """Variables for MODEL, in the shapes `MODEL.init` gives, drawn on the host (an eager
    `MODEL.init` compiles a program per op); only given to calls refused for their x."""
    shapes = jax.eval_shape(lambda x: MODEL.init(jax.random.PRNGKey(0), x), X[:1])
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)


class Frame:
    """What fuseloop sees of a pandas DataFrame or Series: `__array__`, a shape, a length,
    iteration over its column names, and no `dtype` of its own (a frame has `dtypes`)."""

    def __init__(self, values: np.ndarray):
        self._values = values
        self.shape = values.shape
        self.columns = [f"c{i}" for i in range(values.shape[-1])] if values.ndim > 1 else []

    def __array__(self, dtype=None, copy=None):
        return self._values if dtype is None else self._values.astype(dtype)

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self):
        return iter(self.columns)


def test_validation_batches_of_data_frames_validate_as_the_evaluator_reads_them():
    val = [(Frame(X[32:]), Frame(Y[32:]))]
    loop = fl.trainer(MODEL, "binary_cross_entropy", "adam")
    state = loop.validate(MODEL, val).run([(X[:32], Y[:32])], epochs=1)
    alone = fl.evaluator(MODEL, "binary_cross_entropy").run([(X[32:], Y[32:])], state.params)
    assert state.metrics["validation_loss"] == alone.metrics["loss"]


def test_a_scipy_sparse_matrix_is_refused_with_its_dense_form_named():
    sparse = pytest.importorskip("scipy.sparse")
    x = sparse.csr_matrix(X)
    with pytest.raises(ValueError, match=r"x is a scipy sparse matrix .*\.toarray\(\)"):
        fl.data.arrays(x, Y, batch_size=16)
    with pytest.raises(ValueError, match=r"x is a scipy sparse matrix"):
        fl.predict(MODEL, _variables(), x)
    loop = fl.trainer(MODEL, "binary_cross_entropy", "adam")
    with pytest.raises(ValueError, match=r"leaf of the batch is a scipy sparse matrix"):
        loop.run([(x[:16], Y[:16])])
    dense = loop.run(fl.data.arrays(x.toarray(), Y, batch_size=16), epochs=1)
    assert np.isfinite(dense.metrics["loss"])


def test_a_jax_sparse_array_is_refused_where_fuseloop_slices_examples():
    """A BCOO's leaves are its non-zeros and their indices: fl.data.arrays took a diagonal
    matrix of 48 non-zeros for 48 examples and batched its non-zeros."""
    from jax.experimental import sparse

    # The 48 x 48 identity, built from its non-zeros and their indices on the host
    # (BCOO.fromdense runs some thirty eager operations, each its own compile).
    diagonal = np.arange(len(X))
    bcoo = sparse.BCOO(
        (np.ones(len(X), np.float32), np.stack([diagonal, diagonal], 1)), shape=(len(X), len(X))
    )
    assert bcoo.data.shape[0] == len(Y)  # as many non-zeros as examples: it was taken
    with pytest.raises(ValueError, match=r"x\['ids'\] is a jax.experimental.sparse BCOO .*dense"):
        fl.data.arrays({"ids": bcoo}, Y, batch_size=16)
    with pytest.raises(ValueError, match=r"x is a jax.experimental.sparse BCOO"):
        fl.predict(MODEL, _variables(), bcoo)
    # A generator's (or a callable's) batch is named as the batch of the source it is.
    dense = np.eye(len(X), dtype=np.float32)[:16]
    for source in ((b for b in (dense, bcoo)), lambda: iter([bcoo])):
        with pytest.raises(ValueError, match=r"x \(batch \d of the source\) is a jax.exp"):
            fl.predict(MODEL, _variables(), source)


@pytest.mark.parametrize(
    "loss, y",
    [
        ("categorical_cross_entropy", Y[:, None]),
        ("sparse_categorical_cross_entropy", Y.astype(np.int32)),
    ],
)
def test_a_one_unit_output_under_a_softmax_loss_is_refused_naming_the_binary_loss(loss, y):
    with pytest.raises(ValueError, match=r"one class there.*loss is 0.*binary_cross_entropy"):
        fl.trainer(MODEL, loss, "adam").run([(X[:16], y[:16])])


def test_a_1d_output_under_categorical_cross_entropy_is_left_to_the_user():
    # One example's class scores (no batch axis), or a softmax across the batch on
    # purpose (listwise ranking): both train as before.
    def apply(params, x):
        return x @ params["w"]

    model = fl.models.from_functions(lambda key, x: {"w": np.ones((3,), np.float32)}, apply)
    one_hot = np.eye(16, dtype=np.float32)[0]
    state = fl.trainer(model, "categorical_cross_entropy", "sgd").run([(X[:16], one_hot)])
    assert np.isfinite(state.metrics["loss"]) and state.metrics["loss"] > 0


@pytest.mark.filterwarnings("ignore:data. leaf y is float64")
def test_float64_labels_under_sparse_cross_entropy_name_no_narrowed_dtype():
    model = fl.models.mlp([4, 3])
    with pytest.raises(ValueError) as refused:
        fl.trainer(model, "sparse_categorical_cross_entropy", "sgd").run(
            [(X[:16], (np.arange(16) % 3).astype(np.float64))]
        )
    # y is float64 on the host: the dtype named is the device's, said to be.
    assert "y holds floats (float32 on the device)" in str(refused.value)


class ValuesOnly:
    """An xarray-like object with a shape and `.values` but no `__array__`."""

    def __init__(self, values: np.ndarray):
        self.values, self.shape, self.dtype = values, values.shape, values.dtype


def test_a_masked_array_or_an_object_numpy_cannot_read_is_refused_where_it_is_given():
    """A masked array (netCDF's data with a fill value) lost its mask and its fill values
    were trained on; an object with only a shape was accepted, then failed with numpy's
    IndexError."""
    raw = X.copy()
    raw[::4, 1] = 1e30
    masked = np.ma.masked_greater(raw, 1e29)
    fix = r"x is a numpy masked array \(12 masked entries\).*x.filled\(value\)"
    for device in (False, True):
        with pytest.raises(ValueError, match=fix):
            fl.data.arrays(masked, Y, batch_size=16, device=device)
    with pytest.raises(ValueError, match=fix):
        fl.predict(MODEL, _variables(), masked)
    with pytest.raises(ValueError, match=r"x is a numpy masked array \(4 masked entries"):
        fl.trainer(MODEL, "binary_cross_entropy", "adam").run([(masked[:16], Y[:16])], fuse=2)
    with pytest.raises(ValueError, match=r"batch 1 of the chunk is a numpy masked array"):
        batches = [(X[:16], Y[:16]), (masked[16:32], Y[16:32])]  # a later batch of a chunk
        fl.trainer(MODEL, "binary_cross_entropy", "adam").run(batches, fuse=2)
    with pytest.raises(ValueError, match=r"x is a ValuesOnly of shape \(48, 3\) .*x.values"):
        fl.data.arrays(ValuesOnly(X), Y, batch_size=16)
    # Nothing masked, or numpy's buffer protocol: read as arrays, as before.
    for readable in (np.ma.array(X), memoryview(X)):
        assert fl.data.arrays(readable, Y, batch_size=16).n == len(Y)
        fl.trainer(MODEL, "binary_cross_entropy", "adam").run([(readable, Y)] * 2, fuse=2)
