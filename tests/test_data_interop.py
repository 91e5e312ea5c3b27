"""Data from the loaders users already have: torch tensors (read through `Tensor.numpy()`,
never numpy's `__array__`), lists that mix kinds of batches, and Python containers where
arrays belong, each refused with the fix in its message (one message, not one per number).

`torch` is an optional extra; the tensor tests use a stand-in with the few methods
fuseloop reads of a tensor, whose `__array__` fails the test if it is used. A test on
the real torch runs where it is installed."""

from __future__ import annotations

import re
import sys
import types
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_runs_identical, assert_tree_equal, make_batches, tiny_mlp, trainer


class _Tensor:
    """What fuseloop reads of a `torch.Tensor`: `detach().cpu()...numpy()`, `view(int16)`
    for bfloat16. Reading it through numpy's protocol (`np.asarray(tensor)`, which warns
    under numpy 2 and fails for bfloat16 or a tensor requiring grad) fails the test."""

    def __init__(self, values: np.ndarray, dtype: str = "float32"):
        self.values, self.dtype = values, dtype
        self.detached = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def detach(self) -> _Tensor:
        copy = _Tensor(self.values, self.dtype)
        copy.detached = True
        return copy

    def cpu(self) -> _Tensor:
        return self

    def resolve_conj(self) -> _Tensor:
        return self

    def resolve_neg(self) -> _Tensor:
        return self

    def view(self, dtype: str) -> _Tensor:
        assert dtype == "int16" and self.dtype == "bfloat16"
        bits = _Tensor(self.values.view(np.int16), "int16")
        bits.detached = self.detached
        return bits

    def numpy(self) -> np.ndarray:
        assert self.detached, "a tensor that requires grad has no numpy() before detach()"
        return self.values

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise AssertionError("read through numpy's __array__ protocol")


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = types.SimpleNamespace(Tensor=_Tensor, bfloat16="bfloat16", int16="int16")
    monkeypatch.setitem(sys.modules, "torch", torch)


def _tensors(batches: list[Any], dtype: str = "float32") -> list[Any]:
    return [(_Tensor(x, dtype), _Tensor(y, "int32")) for x, y in batches]


@pytest.mark.usefixtures("fake_torch")
@pytest.mark.parametrize("fuse", [False, 3])
def test_tensor_batches_train_as_their_numpy_values_in_any_kind_of_source(fuse):
    batches = make_batches(6)
    reference = trainer().run(batches, fuse=fuse)
    mixed = batches[:2] + _tensors(batches[2:3]) + batches[3:]  # numpy first, then a tensor
    for data in (_tensors(batches), mixed, lambda: iter(_tensors(batches))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy 2 warns on a tensor's __array__
            state = trainer().run(data, fuse=fuse)
        assert_tree_equal(state.step_state, reference.step_state, "step_state")


@pytest.mark.usefixtures("fake_torch")
def test_bfloat16_tensors_arrive_as_jaxs_bfloat16_bit_for_bit():
    batches = [(x.astype(jnp.bfloat16), y) for x, y in make_batches(4)]
    as_bits = [(x.view(np.int16), y) for x, y in batches]
    tensors = [(_Tensor(bits.view(jnp.bfloat16), "bfloat16"), y) for bits, y in as_bits]
    reference = trainer().run(batches, fuse=False)
    state = trainer().run(lambda: iter(tensors), fuse=False)
    assert_tree_equal(state.step_state, reference.step_state, "step_state")


@pytest.mark.usefixtures("fake_torch")
def test_predict_reads_tensors_as_training_does():
    batches = make_batches(3)
    state = trainer().run(batches)
    model = tiny_mlp()
    reference = fl.predict(model, state.params, [x for x, _ in batches])
    for given in ([_Tensor(x) for x, _ in batches], _tensors(batches)):
        np.testing.assert_array_equal(fl.predict(model, state.params, given), reference)


@pytest.mark.usefixtures("fake_torch")
def test_in_memory_arrays_of_tensors_are_read_as_batches_are():
    # fl.data.arrays copied tensors through numpy's __array__ (a warning per call under
    # numpy 2; bfloat16 and tensors requiring grad failed).
    batches = make_batches(4)
    x, y = (np.concatenate(part) for part in zip(*batches, strict=True))
    reference = trainer().run(fl.data.arrays(x, y, batch_size=4, shuffle=False))
    given = fl.data.arrays(_Tensor(x), _Tensor(y, "int32"), batch_size=4, shuffle=False)
    assert_tree_equal(trainer().run(given).step_state, reference.step_state, "step_state")


def test_real_torch_tensors_bfloat16_and_requiring_grad_train():
    torch = pytest.importorskip("torch")
    batches = make_batches(4)
    reference = trainer().run(batches, fuse=False)
    tensors = [
        (torch.from_numpy(x.copy()).requires_grad_(), torch.from_numpy(y)) for x, y in batches
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        state = trainer().run(lambda: iter(tensors), fuse=False)
    assert_tree_equal(state.step_state, reference.step_state, "step_state")
    bf16 = [(torch.from_numpy(x).bfloat16(), torch.from_numpy(y)) for x, y in batches]
    bf16_reference = trainer().run([(x.astype(jnp.bfloat16), y) for x, y in batches])
    state = trainer().run(lambda: iter(bf16), fuse=False)
    assert_tree_equal(state.step_state, bf16_reference.step_state, "step_state")


def test_a_leaf_that_cannot_become_an_array_is_placed_in_a_note():
    class Opaque:
        def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
            raise RuntimeError("cannot export")

    batches = make_batches(3)
    data = lambda: iter(batches[:2] + [(Opaque(), batches[2][1])])  # noqa: E731
    with pytest.raises(RuntimeError, match="cannot export") as caught:
        trainer().run(data, fuse=False)
    notes = " ".join(caught.value.__notes__)
    assert "converting a leaf of the batch for epoch 0, iteration 2" in notes


def test_a_map_style_dataset_is_told_to_go_through_a_loader():
    class Indexed:  # torch's map-style Dataset: examples by index, no __iter__
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
            return np.zeros(3, np.float32), 0

    with pytest.raises(ValueError, match=r"If data\[i\] is one example .*DataLoader\(data, bat"):
        trainer().run(Indexed())


class _KerasStyle:
    """A keras.utils.PyDataset's shape: batches by index, reshuffled by on_epoch_end."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.order = np.arange(len(x))
        self.calls: list[str] = []

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.order[i * self.batch_size : (i + 1) * self.batch_size]
        self.calls.append(f"get {i}")
        return self.x[rows], self.y[rows]

    def on_epoch_end(self) -> None:
        self.calls.append("end")
        self.order = np.random.default_rng(len(self.calls)).permutation(len(self.x))


@pytest.mark.parametrize("fuse", [False, 2])
def test_a_keras_style_sequence_is_read_by_batch_with_its_epoch_hooks(fuse):
    x, y = _xy(20 if fuse is False else 24)
    sequence = _KerasStyle(x, y, batch_size=8)  # batches of 8, 8 and 4 (or 8) examples
    state = trainer().run(sequence, epochs=3, fuse=fuse)
    # Each epoch reads batches 0, 1, 2; on_epoch_end runs between epochs, as Keras runs it.
    epoch = ["get 0", "get 1", "get 2"]
    assert sequence.calls == [*epoch, "end", *epoch, "end", *epoch]
    # The run trained on exactly those batches: the same run over the list they make.
    replayed = _KerasStyle(x, y, batch_size=8)
    per_epoch = []
    for e in range(3):
        per_epoch.append([replayed[i] for i in range(len(replayed))])
        if e < 2:
            replayed.on_epoch_end()
    epochs = iter(per_epoch)
    reference = trainer().run(lambda: iter(next(epochs)), epochs=3, fuse=fuse)
    assert_runs_identical(state, reference)


def test_auto_fuse_knows_a_sequences_length_as_a_lists():
    x, y = _xy(24)
    sequence = _KerasStyle(x, y, batch_size=8)  # 3 batches an epoch
    as_list = [sequence[i] for i in range(len(sequence))]
    by_list = trainer().run(as_list, epochs=1, fuse="auto")
    state = trainer().run(_KerasStyle(x, y, batch_size=8), epochs=1, fuse="auto")
    assert state.stats["chunk_size"] == by_list.stats["chunk_size"] == 3


def test_a_sequence_epoch_ends_when_cut_short_and_across_runs():
    x, y = _xy(24)
    sequence = _KerasStyle(x, y, batch_size=8)
    loop = trainer()
    loop.run(sequence, epochs=2, iterations=2)  # epochs of 2 of its 3 batches
    assert sequence.calls == ["get 0", "get 1", "end", "get 0", "get 1"]
    loop.run(sequence, epochs=1)  # a later run ends the last epoch first, as a new fit
    assert sequence.calls[5:] == ["end", "get 0", "get 1", "get 2"]


def test_a_sequence_is_known_by_identity_across_runs():
    # An unhashable sequence (a dataclass, say) still has its open epoch ended by the next
    # run over it, and a new sequence equal to one used before has no epoch of its own to
    # end: its first epoch reads the order it was made with.
    x, y = _xy(24)

    class Unhashable(_KerasStyle):
        __hash__ = None  # type: ignore[assignment]

        def __eq__(self, other: object) -> bool:
            return isinstance(other, _KerasStyle)

    loop = trainer()
    first = Unhashable(x, y, batch_size=8)
    loop.run(first, epochs=1)
    loop.run(first, epochs=1)
    assert first.calls.count("end") == 1
    second = Unhashable(x, y, batch_size=8)  # equal to `first`, which is still open
    loop.run(second, epochs=1)
    assert "end" not in second.calls

    class EqualByConfig(_KerasStyle):  # hashable and equal: a frozen dataclass's kind
        def __eq__(self, other: object) -> bool:
            return isinstance(other, _KerasStyle)

        def __hash__(self) -> int:
            return 0

    loop.run(EqualByConfig(x, y, batch_size=8), epochs=1)
    fresh = EqualByConfig(x, y, batch_size=8)
    loop.run(fresh, epochs=1)
    assert "end" not in fresh.calls


def test_an_endless_sequence_needs_iterations():
    x, y = _xy(16)

    class Endless(_KerasStyle):
        __len__ = None  # type: ignore[assignment]
        num_batches = None  # Keras 3's PyDataset: an endless dataset

        def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
            return super().__getitem__(i % 2)

    with pytest.raises(ValueError, match=r"endless sequence.*iterations=N"):
        trainer().run(Endless(x, y, batch_size=8), epochs=1)
    with pytest.raises(ValueError, match=r"endless sequence.*fl\.predict reads"):
        fl.predict(tiny_mlp(), trainer().run(make_batches(2)).params, Endless(x, y, 8))
    with pytest.raises(ValueError, match=r"endless sequence.*validation reads its data"):
        trainer().validate(tiny_mlp(), Endless(x, y, 8))

    class NumpyCount(Endless):
        num_batches = np.int64(2)  # as np.ceil(n / batch_size) makes it

    state = trainer().run(NumpyCount(x, y, batch_size=8), epochs=2)
    assert state.event_counts["iteration_completed"]["total"] == 4
    state = trainer().run(Endless(x, y, batch_size=8), epochs=2, iterations=3)
    assert state.event_counts["iteration_completed"]["total"] == 6


def test_a_keras_3_sequence_may_count_its_batches_with_num_batches():
    x, y = _xy(16)

    class Counted(_KerasStyle):
        __len__ = None  # type: ignore[assignment]  # Keras 3: num_batches instead
        num_batches = 2

    state = trainer().run(Counted(x, y, batch_size=8), epochs=2)
    assert state.event_counts["iteration_completed"]["total"] == 4


# --------------------------------------------------------------- Python containers
def _xy(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda x, y: (list(x), y), r"^x is a Python list of 40 ndarrays .*: np\.stack\(x\)$"),
        (
            lambda x, y: ([{"a": row} for row in x], y),
            r"^x is a Python list of 40 dicts .*np\.stack\(\[r\[k\] for r in x\]\)",
        ),
        (
            lambda x, y: ({"a": x, "ids": list(range(40))}, y),
            r"^x\['ids'\] is a Python list of numbers.*np\.asarray\(x\['ids'\]",
        ),
        (lambda x, y: ({"a": x.tolist()}, y), r"^x\['a'\] is a Python list of numbers"),
        (lambda x, y: (x, {"y": y.tolist()}), r"^y\['y'\] is a Python list of numbers"),
    ],
)
def test_arrays_given_python_containers_name_the_container_and_the_fix(make, message):
    x, y = make(*_xy())
    with pytest.raises(ValueError, match=message) as caught:
        fl.data.arrays(x, y, batch_size=8)
    assert len(str(caught.value)) < 300  # not every row's size, nor every number


def test_a_tuple_of_inputs_with_a_wrong_y_is_told_to_slice_not_to_stack():
    x, y = _xy(5)
    with pytest.raises(ValueError, match=r"must share the leading .*y: 2; slice"):
        fl.data.arrays((x, x), y[:2], batch_size=1)  # two inputs, not two examples


def test_arrays_of_many_leaves_that_disagree_list_a_few():
    x, y = _xy()
    many = {f"f{i}": x[: 30 if i == 0 else 40] for i in range(20)}
    with pytest.raises(ValueError, match=r"must share the leading .*, and 15 more; slice"):
        fl.data.arrays(many, y, batch_size=8)


@pytest.mark.parametrize("nested", ["list", "ids"])
def test_a_batch_holding_a_python_list_is_one_message_naming_it(nested):
    x, y = _xy(16)
    given = {"a": x.tolist()} if nested == "list" else {"a": x, "ids": list(range(16))}
    path = "x['a']" if nested == "list" else "x['ids']"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float64 warning listing every number first
        with pytest.raises(ValueError, match=rf"{re.escape(path)} is a Python list of") as caught:
            trainer().run([(given, y)])
    assert len(str(caught.value)) < 400


def test_rows_held_as_python_objects_are_told_to_be_stacked():
    rows = np.empty(8, object)  # a pandas Series of row arrays: .values
    rows[:] = [np.ones(3, np.float32)] * 8
    source = fl.data.arrays(rows, np.arange(8, dtype=np.int32) % 3, batch_size=4)
    with pytest.raises(ValueError, match=r"arrays held as Python objects.*np\.stack\(x\)"):
        trainer().run(source)


def test_python_numbers_in_a_batch_arrive_in_jaxs_default_dtypes():
    # A per-batch weight given as a Python float is no float64 array to narrow (it was
    # warned of as one); a step that promotes a bfloat16 leaf with it is told about it.
    x = np.ones((2, 3), np.float32)
    seen = []

    def step(batch, s):
        seen.append((batch[1].dtype, batch[2].dtype, batch[3].dtype))
        return {"n": s["n"] + batch[1] * batch[2]}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = fl.loop(step).run([(x, 0.5, 2, True)] * 2, {"n": jnp.float32(0)}, fuse=False)
    assert float(state.step_state["n"]) == 2.0
    assert seen[-1] == (jnp.float32, jnp.int32, jnp.bool_)
    # A numpy float64 (a float subclass) is numpy's array, narrowed as one, with its warning.
    with pytest.warns(UserWarning, match=r"float64"):
        fl.loop(step).run([(x, np.float64(0.5), 2, True)] * 2, {"n": jnp.float32(0)}, fuse=False)

    def ema(batch, s):
        return {"ema": s["ema"] * 0.9 + batch[1]}

    with pytest.raises(ValueError, match=r"bfloat16 .* to dtype float32.*not weakly typed"):
        fl.loop(ema).run([(x, 0.5)] * 2, {"ema": jnp.bfloat16(0)}, fuse=False)


@pytest.mark.parametrize("fuse", [False, 2])
def test_a_halt_in_a_sequences_last_chunk_does_not_open_its_next_epoch(fuse):
    # terminate_on_nan halts in epoch 0's last chunk; a fused run may open the next epoch
    # ahead of that chunk's verdict, which over a sequence would run its on_epoch_end
    # (a reshuffle) for an epoch that never runs: the resumed run's order would change.
    x, y = _xy(16)
    x[12:] = np.nan  # the last batch of the first pass only
    sequence = _KerasStyle(x, y, batch_size=4)
    loop = trainer().terminate_on_nan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = loop.run(sequence, epochs=2, fuse=fuse)
    assert (state.epoch, state.iteration) == (0, 3)
    assert sequence.calls == ["get 0", "get 1", "get 2", "get 3"]
