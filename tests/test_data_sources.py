"""Every kind of data `run` accepts, fused (K=4) and unfused: the batches each epoch sees,
exact consumption (pull counts == steps) and closing."""

from __future__ import annotations

import gc
import io
import weakref
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import fuseloop as fl

FEATURES, CLASSES, BATCH, N_BATCHES = 3, 2, 8, 6
FUSES = [False, 4]


def _batches(n: int = N_BATCHES, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        out.append((x, (x.sum(axis=1) > 0).astype(np.int32)))
    return out


BATCHES = _batches()
LOOP = fl.trainer(
    fl.models.mlp([4, CLASSES]), "sparse_categorical_cross_entropy", optax.sgd(0.1)
).metric("accuracy")


def _leaves(state) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(state.step_state)]


def _assert_same_params(a, b) -> None:
    for u, v in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)


def _assert_same_run(a, b) -> None:
    _assert_same_params(a, b)
    assert a.history == b.history


def _steps(state) -> int:
    return int(state.step_state["step"])


class Counting:
    """A one-shot generator of `batches` that counts pulls and notes when it is closed."""

    def __init__(self, batches: list[Any]):
        self.batches, self.pulled, self.closed, self.finished = batches, 0, False, False
        self.generator = self._run()

    def _run(self) -> Iterator[Any]:
        try:
            for batch in self.batches:
                self.pulled += 1
                yield batch
            self.finished = True
        finally:
            self.closed = True


class Reiterable:
    """A fresh pass over `batches` each time it is iterated; counts passes, pulls, closes."""

    def __init__(self, batches: list[Any]):
        self.batches, self.passes, self.pulled, self.closed = batches, 0, 0, 0
        self.pulled_per_pass: list[int] = []

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        self.pulled_per_pass.append(0)
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        try:
            for batch in self.batches:
                self.pulled += 1
                self.pulled_per_pass[-1] += 1
                yield batch
        finally:
            self.closed += 1


# --------------------------------------------------------------------- each kind
@pytest.mark.parametrize("fuse", FUSES)
def test_list_is_a_fresh_pass_each_epoch_and_fused_equals_unfused(fuse):
    state = LOOP.run(BATCHES, epochs=2, fuse=fuse)
    assert _steps(state) == 2 * N_BATCHES and sorted(state.history) == [0, 1]
    _assert_same_run(state, LOOP.run(list(BATCHES), epochs=2, fuse=not fuse and 4))


@pytest.mark.parametrize("fuse", FUSES)
def test_reiterable_gets_one_fresh_pass_per_epoch(fuse):
    source = Reiterable(BATCHES)
    state = LOOP.run(source, epochs=3, fuse=fuse)
    assert source.passes == 3 and source.pulled_per_pass == [N_BATCHES] * 3
    assert _steps(state) == 3 * N_BATCHES
    _assert_same_run(state, LOOP.run(BATCHES, epochs=3, fuse=fuse))


@pytest.mark.parametrize("fuse", FUSES)
def test_reiterable_bounded_by_iterations_closes_each_unfinished_pass(fuse):
    source = Reiterable(BATCHES)
    state = LOOP.run(source, epochs=3, iterations=5, fuse=fuse)
    assert _steps(state) == 15 and source.passes == 3
    assert source.closed == 3  # each pass stopped at 5 of 6 batches was closed
    _assert_same_run(state, LOOP.run(BATCHES[:5], epochs=3, fuse=fuse))


class EpochOrdered(Reiterable):
    """A loader whose order is set per epoch (torch's `DistributedSampler.set_epoch`)."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        order = np.random.default_rng(self.epoch).permutation(len(self.batches))
        return iter([self.batches[i] for i in order])


@pytest.mark.parametrize("fuse", FUSES)
def test_a_first_epoch_reads_a_pass_opened_after_its_epoch_started_handlers(fuse):
    """The run's first epoch read the pass its first batch came from, opened before the
    `epoch_started` handlers ran: a list shuffled in place there, or a loader's epoch set
    there, reached every epoch but a run's first (a resumed run's first: a stale order)."""
    order = list(BATCHES)
    reversing = LOOP.handle_event("epoch_started", lambda s: order.reverse())
    reversed_once = LOOP.run(BATCHES[::-1], epochs=1, fuse=fuse)
    _assert_same_run(reversing.run(order, epochs=1, fuse=fuse), reversed_once)
    loader = EpochOrdered(BATCHES)
    loop = LOOP.handle_event("epoch_started", lambda s: loader.set_epoch(s.epoch))
    whole = loop.run(loader, epochs=3, fuse=fuse)
    half = loop.run(loader, epochs=2, fuse=fuse)  # (the loader is left at epoch 2)
    _assert_same_run(loop.run(loader, half, epochs=3, fuse=fuse), whole)


class Shuffling(Reiterable):
    """A loader drawing each pass's order from its own generator (a seeded torch
    DataLoader): every pass opened moves the order of the passes after it."""

    def __init__(self, batches: list[Any]):
        super().__init__(batches)
        self.rng = np.random.default_rng(7)

    def __iter__(self) -> Iterator[Any]:
        order = self.rng.permutation(len(self.batches))
        self.passes += 1
        return iter([self.batches[i] for i in order])


def _own_handlers(loop: fl.Loop, path: Any) -> list[fl.Loop]:
    val = _batches(2, seed=5)
    return [
        loop.validate(loop.program.model, val),
        loop.csv_log(str(path / "m.csv")),
        loop.checkpoint(str(path / "c")),
        loop.early_stop("loss", patience=5, restore_best=True),
        fl.trainer(
            fl.models.mlp([4, CLASSES]),
            "sparse_categorical_cross_entropy",
            optax.sgd(0.1),
            log=100,
            log_stream=io.StringIO(),
        ).metric("accuracy"),
    ]


@pytest.mark.parametrize("fuse", FUSES)
def test_fuseloops_own_start_handlers_do_not_open_the_first_pass_again(fuse, tmp_path):
    # validate, a log, a writer, a checkpoint and restore_best attach "started" handlers
    # of their own: the run opened its first pass again for them, one more draw of a
    # seeded loader's order, and trained on other batches than without them.
    plain = LOOP.run(Shuffling(BATCHES), epochs=2, fuse=fuse)
    for loop in _own_handlers(LOOP, tmp_path):
        loader = Shuffling(BATCHES)
        state = loop.run(loader, epochs=2, fuse=fuse)
        assert loader.passes == 2
        _assert_same_params(state, plain)
    # fuseloop's handler object attached by the user does what its builder does.
    stopper = fl.handlers.monitor.EarlyStopping("loss", patience=5, restore_best=True)
    loader = Shuffling(BATCHES)
    LOOP.handle_event("epoch_completed", stopper).run(loader, epochs=2, fuse=fuse)
    assert loader.passes == 2
    opened_again = Shuffling(BATCHES)  # a handler of the user's still opens it again
    LOOP.observe("started", lambda s: None).run(opened_again, epochs=2, fuse=fuse)
    assert opened_again.passes == 3


class Persistent(Reiterable):
    """A loader handing out the same iterator object each pass, reset (torch's
    `persistent_workers=True`)."""

    def __init__(self, batches: list[Any]):
        super().__init__(batches)
        self.iterator = _Resettable(batches)

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        self.iterator.at = 0
        return self.iterator


class _Resettable:
    def __init__(self, batches: list[Any]):
        self.batches, self.at = batches, 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.at == len(self.batches):
            raise StopIteration
        self.at += 1
        return self.batches[self.at - 1]


@pytest.mark.parametrize("fuse", FUSES)
def test_a_pass_opened_again_as_the_same_iterator_does_not_step_the_first_batch_twice(fuse):
    # The batch pulled to initialize was kept for the pass opened again after a user's
    # epoch_started handler, since the loader returned the same iterator: epoch 0 ran
    # N + 1 steps, its first batch twice.
    loop = LOOP.handle_event("epoch_started", lambda s: None)
    state = loop.run(Persistent(BATCHES), epochs=2, fuse=fuse)
    assert _steps(state) == 2 * N_BATCHES
    _assert_same_run(state, LOOP.run(BATCHES, epochs=2, fuse=fuse))


@pytest.mark.parametrize("fuse", FUSES)
def test_a_validation_of_the_training_data_at_epoch_end_opens_nothing_again(fuse):
    # Its start check reads no loader: only a validation at epoch_started reads the pass.
    loader = Shuffling(BATCHES)
    LOOP.validate(LOOP.program.model, loader).run(loader, epochs=2, fuse=fuse)
    assert loader.passes == 2 + 2  # each epoch's training pass and its validation's


@pytest.mark.parametrize("fuse", FUSES)
def test_a_validation_on_the_training_data_itself_reopens_the_first_pass(fuse):
    # It reads the run's own loader at epoch_started: where the loader hands out one
    # iterator, the validation drains the pass the first batch came from.
    loader = Persistent(BATCHES)
    loop = LOOP.validate(LOOP.program.model, loader, event="epoch_started")
    state = loop.run(loader, epochs=2, fuse=fuse)
    assert _steps(state) == 2 * N_BATCHES


def test_the_first_pass_is_let_go_when_the_run_opens_it_again():
    # A loader's worker processes live as long as its pass: the one opened for the first
    # batch stayed referenced, its workers running, for the whole run.
    passes: list[weakref.ref] = []

    class Tracked(Reiterable):
        def __iter__(self) -> Iterator[Any]:
            iterator = super().__iter__()
            passes.append(weakref.ref(iterator))
            return iterator

    alive: list[bool] = []

    def first_step(state: fl.State) -> None:
        gc.collect()
        alive.append(passes[0]() is not None)

    loop = LOOP.observe("iteration_started", first_step, {"once": 1})
    loop.observe("started", lambda s: None).run(Tracked(BATCHES), epochs=1)
    assert len(passes) == 2 and alive == [False]


@pytest.mark.parametrize("fuse", FUSES)
def test_callable_is_called_once_per_epoch(fuse):
    calls: list[int] = []

    def make() -> Iterator[Any]:
        calls.append(1)
        return iter(BATCHES)

    state = LOOP.run(make, epochs=3, fuse=fuse)
    assert len(calls) == 3 and _steps(state) == 3 * N_BATCHES
    _assert_same_run(state, LOOP.run(BATCHES, epochs=3, fuse=fuse))


@pytest.mark.parametrize("fuse", FUSES)
def test_callable_iterators_stopped_by_the_bound_are_closed(fuse):
    source = Reiterable(BATCHES)  # its passes are generators with a finally
    state = LOOP.run(source.__iter__, epochs=2, iterations=3, fuse=fuse)
    assert _steps(state) == 6 and source.passes == 2 and source.pulled_per_pass == [3, 3]
    assert source.closed == 2


@pytest.mark.parametrize("fuse", FUSES)
def test_one_shot_generator_is_consumed_across_epochs_exactly(fuse):
    many = _batches(20, seed=3)
    source = Counting(many)
    state = LOOP.run(source.generator, epochs=3, iterations=5, fuse=fuse)
    assert _steps(state) == 15 and source.pulled == 15
    assert source.closed and not source.finished  # the unexhausted generator was closed
    # epoch e trained on batches 5e..5e+4: the same as a list holding them in order
    _assert_same_params(state, LOOP.run(many[:15], epochs=1, fuse=fuse))


@pytest.mark.parametrize("fuse", FUSES)
def test_one_shot_iterator_without_a_bound_runs_until_exhausted(fuse):
    source = Counting(_batches(7, seed=4))
    state = LOOP.run(source.generator, epochs=1, fuse=fuse)
    assert _steps(state) == 7 and source.pulled == 7 and source.finished and source.closed


@pytest.mark.parametrize("fuse", FUSES)
@pytest.mark.parametrize("status", ["halt_loop", "halt_epoch"])
def test_one_shot_generator_closed_when_an_epoch_handler_halts(fuse, status):
    source = Counting(_batches(30, seed=5))
    loop = LOOP.handle_event("epoch_completed", lambda s: status, filter="first")
    state = loop.run(source.generator, epochs=3, iterations=4, fuse=fuse)
    assert source.pulled == _steps(state) and source.closed and not source.finished
    assert _steps(state) == (4 if status == "halt_loop" else 12)


@pytest.mark.parametrize("fuse", FUSES)
def test_one_shot_generator_closed_when_a_handler_raises(fuse):
    source = Counting(_batches(30, seed=5))

    def boom(state):
        raise RuntimeError("handler failed")

    loop = LOOP.handle_event("epoch_completed", boom)
    with pytest.raises(RuntimeError, match="handler failed"):
        loop.run(source.generator, epochs=3, iterations=4, fuse=fuse)
    assert source.closed and source.pulled == 4


@pytest.mark.parametrize("fuse", FUSES)
def test_reiterable_pass_closed_when_the_run_raises_mid_epoch(fuse):
    source = Reiterable(BATCHES)

    def boom(state):
        raise KeyError("stop here")

    loop = LOOP.handle_event("iteration_completed", boom, filter={"once": 3})
    with pytest.raises(KeyError):
        loop.run(source, epochs=2, fuse=fuse)
    assert source.passes == 1 and source.closed == 1


# --------------------------------------------------------------------- torch
@pytest.mark.parametrize("fuse", FUSES)
def test_torch_dataloader_yielding_numpy_is_a_reiterable(fuse):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    xs = np.concatenate([b[0] for b in BATCHES])
    ys = np.concatenate([b[1] for b in BATCHES])
    dataset = TensorDataset(torch.from_numpy(xs), torch.from_numpy(ys))

    def numpy_collate(items):
        return (np.stack([x.numpy() for x, _ in items]), np.stack([y.numpy() for _, y in items]))

    loader = DataLoader(dataset, batch_size=BATCH, shuffle=False, collate_fn=numpy_collate)
    state = LOOP.run(loader, epochs=2, fuse=fuse)
    _assert_same_run(state, LOOP.run(BATCHES, epochs=2, fuse=fuse))


# --------------------------------------------------------------------- pytrees
class DictModel(nn.Module):
    """Takes `{"a": [B, 3], "b": [B, 2]}`: a dict input, as multi-input models do."""

    @nn.compact
    def __call__(self, x: dict[str, Any]) -> Any:
        h = nn.Dense(4)(x["a"]) + nn.Dense(4)(x["b"])
        return nn.Dense(CLASSES)(nn.relu(h))


DICT_LOOP = fl.trainer(DictModel(), "sparse_categorical_cross_entropy", optax.adam(1e-2)).metric(
    "accuracy"
)


def _dict_batches() -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    rng = np.random.default_rng(6)
    out = []
    for x, y in BATCHES:
        out.append(({"a": x, "b": rng.normal(size=(BATCH, 2)).astype(np.float32)}, y))
    return out


def test_dict_batches_train_a_dict_model_fused_like_unfused():
    batches = _dict_batches()
    unfused = DICT_LOOP.run(batches, epochs=2)
    fused = DICT_LOOP.run(batches, epochs=2, fuse=4)
    _assert_same_run(unfused, fused)
    assert _steps(fused) == 2 * N_BATCHES and np.isfinite(fused.metrics["loss"])


@pytest.mark.parametrize("fuse", FUSES)
@pytest.mark.parametrize("kind", ["callable", "one_shot"])
def test_dict_batches_from_a_loader_train_as_the_list_does(kind, fuse):
    """A loader's batches are copied as they are pulled, leaf by leaf: a dict x once became
    a 0-d object array (and a tuple x one stacked array) on the way to the model."""
    batches = _dict_batches()
    data = (lambda: (b for b in batches)) if kind == "callable" else (b for b in batches)
    _assert_same_run(DICT_LOOP.run(data, fuse=fuse), DICT_LOOP.run(batches, fuse=fuse))


def test_tuple_and_none_parts_from_a_loader_keep_their_form():
    from fuseloop._data import Source

    x, y = BATCHES[0]
    pulled = []
    for batch in ((x, (y, y)), ((x, x[:, :1]), y), (x, None), (x, {"y": y, "w": x[:, 0]})):
        source = Source(lambda batch=batch: (b for b in [batch]))  # a generator: copied
        pulled.extend(source.pull(source.epoch_iterator(0), 1))
    assert [jax.tree.structure(b) for b in pulled] == [
        jax.tree.structure(b)
        for b in ((x, (y, y)), ((x, x[:, :1]), y), (x, None), (x, {"y": y, "w": x[:, 0]}))
    ]
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(pulled))


@pytest.mark.parametrize("fuse", FUSES)
def test_dict_arrays_source_matches_a_list_of_its_batches(fuse):
    batches = _dict_batches()
    x = {k: np.concatenate([b[0][k] for b in batches]) for k in ("a", "b")}
    y = np.concatenate([b[1] for b in batches])
    source = fl.data.arrays(x, y, batch_size=BATCH, shuffle=False)
    _assert_same_run(
        DICT_LOOP.run(source, epochs=2, fuse=fuse), DICT_LOOP.run(batches, epochs=2, fuse=fuse)
    )


@pytest.mark.parametrize("fuse", FUSES)
def test_dict_device_resident_source_matches_the_host_source(fuse):
    batches = _dict_batches()
    x = {k: np.concatenate([b[0][k] for b in batches]) for k in ("a", "b")}
    y = np.concatenate([b[1] for b in batches])
    host = DICT_LOOP.run(fl.data.arrays(x, y, BATCH, seed=2), epochs=2, fuse=fuse)
    device = DICT_LOOP.run(fl.data.arrays(x, y, BATCH, seed=2, device=True), epochs=2, fuse=fuse)
    _assert_same_run(host, device)


def _refilling(batches: list[Any]) -> Iterator[Any]:
    """A loader that refills one pair of buffers for every batch, as hand-written loaders
    often do: each batch it yields is the same two arrays."""
    bx, by = np.empty_like(batches[0][0]), np.empty_like(batches[0][1])
    for x, y in batches:
        bx[...], by[...] = x, y
        yield bx, by


class _RefillingLoader:
    """A re-iterable over `_refilling` passes (a producer thread pulls from it)."""

    def __iter__(self) -> Iterator[Any]:
        return _refilling(BATCHES)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("fuse", FUSES)
@pytest.mark.parametrize("kind", ["callable", "reiterable", "one_shot"])
def test_a_loader_refilling_one_buffer_steps_every_batch(kind, fuse, prefetch):
    epochs = 1 if kind == "one_shot" else 2
    data = {
        "callable": lambda: _refilling(BATCHES),
        "reiterable": _RefillingLoader(),
        "one_shot": _refilling(BATCHES),
    }[kind]
    state = LOOP.run(data, epochs=epochs, fuse=fuse, prefetch=prefetch)
    # The same run on distinct arrays: a chunk or a prefetched batch that kept a reference
    # to the refilled buffer would have stepped the last batch in place of earlier ones.
    _assert_same_run(state, LOOP.run(BATCHES, epochs=epochs, fuse=fuse))


def _rollout_step(batch: Any, s: dict[str, Any]) -> dict[str, Any]:
    """A step that makes its own data (an environment's draw); the batch holds no arrays."""
    assert not jax.tree.leaves(batch)
    draw = jax.random.normal(jax.random.fold_in(s["key"], s["step"]))
    return {**s, "step": s["step"] + 1, "ret": s["ret"] + draw, "loss": draw}


@pytest.mark.parametrize("empty", [None, (), {}], ids=["None", "tuple", "dict"])
def test_batches_holding_no_arrays_run_compiled_fused_and_unfused_as_a_hand_loop(empty):
    # They were stacked into a chunk without a leading axis, whose length the device loop
    # read from its first array: an IndexError, compiled runs only.
    init = {
        "key": jax.random.PRNGKey(0),
        "step": np.int32(0),
        "ret": np.float32(0),
        "loss": np.float32(0),
    }
    hand, draws = init, []
    for _ in range(10):
        hand = jax.jit(_rollout_step)(empty, hand)
        draws.append(hand["loss"])
    loop = fl.loop(_rollout_step).metric("loss")
    unfused = loop.run([empty] * 5, init, fuse=False, epochs=2)
    np.testing.assert_allclose(unfused.history[1]["loss"], np.mean(draws[5:]), rtol=1e-6)
    for fuse in (False, 4, "auto"):
        state = loop.run([empty] * 5, init, fuse=fuse, epochs=2)
        assert int(state.step_state["step"]) == 10
        np.testing.assert_array_equal(state.step_state["ret"], hand["ret"])
        assert state.history == unfused.history
    cut = loop.run(iter([empty] * 9), init, fuse=4, iterations=7)  # a short last chunk
    assert int(cut.step_state["step"]) == 7
