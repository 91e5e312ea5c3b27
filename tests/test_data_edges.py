"""Data a user gets slightly wrong: each is refused or warned about in words that name the
fix, and nothing trains on it silently."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, make_batches, trainer

# One trainer for the file: a test's runs share its compiled programs (and its tracing),
# and a Loop that adds handlers to it shares them too. No test here counts compiles.
LOOP = trainer()


@pytest.mark.parametrize("where", ["last", "first", "middle"])
@pytest.mark.parametrize("fuse", [False, 4])
def test_an_empty_batch_is_refused_before_it_steps(where, fuse):
    data = make_batches(6)
    x, y = data[0]
    empty = (x[:0], y[:0])  # what range(0, n + batch_size, batch_size) slicing ends with
    position = {"last": len(data), "first": 0, "middle": 3}[where]
    data.insert(position, empty)
    with pytest.raises(ValueError, match=r"holds no examples .*Leave empty batches out"):
        LOOP.run(data, fuse=fuse)


@pytest.mark.parametrize("loss", ["sparse_categorical_cross_entropy", "mean_squared_error"])
def test_a_source_of_single_examples_is_told_to_batch_them(loss):
    # As a torch Dataset's items: x of shape (features,), y a scalar. The loss's shape
    # advice (reshape y, change the last layer, use one-hot targets) misled.
    (x, y), *_ = make_batches(1)
    examples = [(x[i], y[i]) for i in range(len(y))]
    with pytest.raises(ValueError, match=r"y has no example axis .*single examples.*arrays"):
        fl.trainer(fl.models.mlp([3]), loss, "sgd").run(examples)
    # A loss of one's own may ignore y (an autoencoder's dummy scalar): it trains.
    ignores_y = lambda y_true, y_pred: (y_pred**2).mean()  # noqa: E731
    assert fl.trainer(fl.models.mlp([3]), ignores_y, "sgd").run([(x, 0.0)]).epoch == 0


def test_a_fused_dtype_mismatch_says_to_cast_the_leaf():
    data = make_batches(4)
    data[2] = (data[2][0], data[2][1].astype(np.int64))
    with pytest.raises(fl.FusionError, match=r"iteration 2: leaf y .*cast it to int32"):
        LOOP.run(data, fuse=4)


@functools.cache
def _observed() -> tuple[fl.Loop, list[int]]:
    """LOOP with an observer listing the iterations stepped (shared by the fuse cases)."""
    steps: list[int] = []
    return LOOP.observe("iteration_completed", lambda s: steps.append(s.iteration)), steps


@pytest.mark.parametrize("fuse", [2, "run"])
def test_a_fused_run_over_arrays_with_a_short_last_batch_is_refused_before_it_steps(fuse):
    x = np.concatenate([b[0] for b in make_batches(3)])[:10]  # batches of 4, 4 and 2
    y = np.concatenate([b[1] for b in make_batches(3)])[:10]
    data = fl.data.arrays(x, y, batch_size=4, drop_remainder=False)
    loop, steps = _observed()
    steps.clear()
    with pytest.raises(fl.FusionError, match=r"last batch holds 2 of the 10 .*drop_remainder"):
        loop.run(data, fuse=fuse)
    assert steps == []  # refused up front, not after training the full batches
    assert loop.run(data, fuse=2, iterations=2).iteration == 1  # the short batch is not reached
    assert loop.run(data, fuse=False).iteration == 2


def _runs_dry_after_one_epoch() -> object:
    calls = {"n": 0}
    batches = make_batches(3)

    def data():
        calls["n"] += 1
        return iter(batches if calls["n"] == 1 else [])

    return data


def test_a_callable_that_runs_dry_is_named_and_the_state_keeps_the_last_metrics():
    with pytest.warns(RuntimeWarning, match=r"epoch 1.*data callable returned an empty"):
        state = LOOP.run(_runs_dry_after_one_epoch(), epochs=3)
    assert state.status == "completed"
    assert state.metrics and state.metrics == state.history[0]


def test_a_one_shot_iterator_that_runs_dry_keeps_its_advice():
    with pytest.warns(RuntimeWarning, match=r"one-shot iterator is consumed across epochs"):
        state = LOOP.run(iter(make_batches(3)), epochs=2)
    assert state.metrics == state.history[0]


def test_an_error_opening_the_data_names_the_epoch_and_the_call():
    calls = {"n": 0}

    def data():
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("the shard list is gone")
        return iter(make_batches(2))

    with pytest.raises(OSError, match="shard list") as caught:
        LOOP.run(data, epochs=2)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "opening the data for epoch 1" in notes and "calling data()" in notes
    with pytest.raises(TypeError) as caught:
        LOOP.run(lambda: 5)
    assert "must give an iterator of batches" in " ".join(caught.value.__notes__)


@pytest.mark.parametrize("which", ["x", "y"])
def test_arrays_given_python_lists_say_to_convert_them(which):
    x, y = make_batches(1)[0]
    given = {"x": x, "y": y}
    given[which] = given[which].tolist()
    with pytest.raises(ValueError, match=rf"{which} is a Python list of numbers.*np.asarray"):
        fl.data.arrays(given["x"], given["y"], batch_size=2)


def test_arrays_given_records_say_to_stack_each_field():
    x, y = make_batches(1)[0]
    records = [{"a": float(row[0]), "b": float(row[1])} for row in x]
    with pytest.raises(ValueError, match=r"x is a Python list of dicts .*np.stack"):
        fl.data.arrays(records, y, batch_size=2)


def test_validation_arrays_that_drop_examples_warn():
    x = np.concatenate([b[0] for b in make_batches(3)])
    y = np.concatenate([b[1] for b in make_batches(3)])
    loop = trainer()
    with pytest.warns(UserWarning, match=r"2 of its 12 examples are left out"):
        loop.validate(loop.program.model, fl.data.arrays(x, y, batch_size=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = fl.data.arrays(x, y, batch_size=5, drop_remainder=False, shuffle=False)
        loop.validate(loop.program.model, kept)
        loop.validate(loop.program.model, fl.data.arrays(x, y, batch_size=4))  # 12 = 3 x 4


def test_an_evaluator_warns_once_where_its_arrays_drop_examples():
    # 10 examples in batches of 4 (the file's batch size, so the programs are shared).
    x = np.concatenate([b[0] for b in make_batches(3)])[:10]
    y = np.concatenate([b[1] for b in make_batches(3)])[:10]
    model = LOOP.program.model
    variables = LOOP.run(make_batches(3)).params
    evaluator = fl.evaluator(model, "sparse_categorical_cross_entropy")
    dropping = fl.data.arrays(x, y, batch_size=4)
    with pytest.warns(UserWarning, match=r"evaluator run: .*2 of its 10 examples are left out"):
        evaluator.run(dropping, variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluator.run(dropping, variables)  # once per dataset
        kept = fl.data.arrays(x, y, batch_size=4, drop_remainder=False)
        evaluator.run(kept, variables)
        LOOP.run(fl.data.arrays(x, y, batch_size=4))  # training may drop a remainder


@pytest.mark.parametrize("fuse", [False, True, "run"])
def test_float64_device_resident_data_warns_as_host_data_does(fuse):
    x, y = _skipped_xy()  # the device dataset of the test below: the same programs
    with pytest.warns(UserWarning, match=r"leaf x is float64.*cast to float32"):
        LOOP.run(fl.data.arrays(x.astype(np.float64), y, 4, seed=3, device=True), fuse=fuse)


@functools.cache
def _skipping(skipped: int) -> tuple[fl.Loop, fl.State]:
    """LOOP halting epoch `skipped` at its start, and its run over the host source (the
    reference every fuse mode's device run is compared with)."""

    def skip(state: fl.State) -> str | None:
        return "halt_epoch" if state.epoch == skipped else None

    loop = LOOP.handle_event("epoch_started", skip)
    return loop, loop.run(fl.data.arrays(*_skipped_xy(), batch_size=4, seed=3), epochs=3)


def _skipped_xy() -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([b[0] for b in make_batches(6)])
    y = np.concatenate([b[1] for b in make_batches(6)])
    return x, y


@pytest.mark.parametrize("skipped", [0, 1])  # the run's first epoch, a later one
@pytest.mark.parametrize("fuse", [False, 4, "run"])
def test_a_skipped_epoch_does_not_shift_a_device_datasets_order(fuse, skipped):
    x, y = _skipped_xy()
    loop, host = _skipping(skipped)
    device = loop.run(fl.data.arrays(x, y, batch_size=4, seed=3, device=True), epochs=3, fuse=fuse)
    assert device.history[2] == host.history[2]
    assert_tree_equal(device.step_state, host.step_state, "step_state")


def test_resuming_from_inside_an_epoch_or_with_nothing_left_warns(tmp_path):
    halt_mid = lambda s: "halt_loop" if (s.epoch, s.iteration) == (1, 2) else None  # noqa: E731
    loop = LOOP
    halted = loop.handle_event("iteration_completed", halt_mid).run(make_batches(6), epochs=3)
    with pytest.warns(
        RuntimeWarning,
        match=r"inside epoch 1 .*last iteration fired: 2; .*the log's Epoch 2, iteration 3",
    ):
        loop.run(make_batches(6), halted, epochs=3)
    done = loop.run(make_batches(6), epochs=2)
    with pytest.warns(RuntimeWarning, match=r"already ran 2 epochs and epochs=2: nothing"):
        again = loop.run(make_batches(6), done, epochs=2)
    # Nothing trained: the State stays where the given one ended.
    assert (again.epoch, again.iteration) == (done.epoch, done.iteration) == (1, 5)
    with pytest.raises(ValueError, match=r"is a path, not a State.*fl.load_state"):
        loop.run(make_batches(6), str(tmp_path), epochs=2)
    # custom-loops.md passes a seed as init_state to fl.loop; a trainer's is its own.
    with pytest.raises(ValueError, match=r"init_state=0 is an integer.*seed=\.\.\."):
        loop.run(make_batches(6), 0)
    # A hand loop's flax TrainState: it was blamed on x not fitting the model.
    from flax.core import freeze  # a FrozenDict is no dict
    from flax.training import train_state

    ts = train_state.TrainState.create(apply_fn=np.dot, params={"w": np.ones(2)}, tx=optax.sgd(1))
    with pytest.raises(ValueError, match=r"TrainState is a hand loop's .*\{'params': ts.params\}"):
        loop.run(make_batches(6), ts)

    class WithStats(train_state.TrainState):  # flax's BatchNorm recipe
        batch_stats: Any
        key: Any

    stats = WithStats.create(
        apply_fn=np.dot, params={}, tx=optax.sgd(1), batch_stats=freeze({"m": 1}), key=np.ones(2)
    )
    with pytest.raises(
        ValueError, match=r"\{'params': ts.params, 'batch_stats': ts.batch_stats\} "
    ):
        loop.run(make_batches(6), stats)
    # Keras's fit(x, y): y went where the variables go and x's rows were read as batches.
    x, y = np.zeros((16, 3), np.float32), np.zeros(16, np.int32)
    with pytest.raises(ValueError, match=r"run\(x, y\) passes y as the initial state"):
        loop.run(x, y, epochs=2)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"is a file, so no checkpoint directory"):
        loop.checkpoint(blocker / "ckpt")


def test_resuming_with_another_optimizer_names_where_their_states_differ():
    model, data = LOOP.program.model, make_batches(2)
    state = LOOP.run(data)  # sparse cross-entropy under "adam"
    adamw = fl.trainer(model, "sparse_categorical_cross_entropy", "adamw")
    # The same optax state types, one more hyperparameter: the message names it.
    with pytest.raises(ValueError, match=r"\['weight_decay'\] only in this optimizer's"):
        adamw.run(data, state, epochs=2)
    sgd = fl.trainer(model, "sparse_categorical_cross_entropy", optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"trained with another optimizer"):
        sgd.run(data, state, epochs=2)
    # optax's adam against its adamw: the same types, one EmptyState more, no leaf apart.
    raw = fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-2)).run(data)
    raw_adamw = fl.trainer(model, "sparse_categorical_cross_entropy", optax.adamw(1e-2))
    with pytest.raises(
        ValueError, match=r"\(ScaleByAdamState, EmptyState\).*\(ScaleByAdamState, EmptyState x2\)"
    ):
        raw_adamw.run(data, raw, epochs=2)


@pytest.mark.parametrize("fuse", [False, 4])
def test_a_source_failing_to_open_the_next_epoch_leaves_the_completed_one_recorded(fuse):
    batches = make_batches(8)
    opened = [0]

    def source():
        opened[0] += 1
        if opened[0] == 2:  # the second epoch's pass cannot be opened
            raise OSError("the shard server went away")
        return iter(batches)

    with pytest.raises(OSError, match="shard server") as caught:
        LOOP.run(source, epochs=3, fuse=fuse)
    state = caught.value.fuseloop_state
    assert sorted(state.history) == [0] and state.epoch == 1
    assert int(state.step_state["step"]) == 8


class _UnknownLength:
    """A source whose len() raises TypeError, as tf.data of unknown length does."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        raise TypeError("The dataset length is unknown.")


def test_a_source_of_unknown_or_zero_length_runs_with_progress_and_auto():
    batches = make_batches(4)
    state = LOOP.run(_UnknownLength(batches), epochs=2, progress=True, fuse="auto")
    assert state.status == "completed"
    report = fl.diagnostics.report(LOOP, _UnknownLength(batches), fuse="auto")
    assert report

    class Zero(_UnknownLength):
        def __len__(self):
            return 0  # says nothing about the batches it yields

    assert LOOP.run(Zero(batches), fuse="auto").status == "completed"


def test_string_labels_of_a_device_source_are_named_before_they_are_moved():
    x = np.concatenate([b[0] for b in make_batches(2)])
    y = np.array(["cat", "dog"])[np.arange(len(x)) % 2]
    with pytest.raises(ValueError, match=r"device=True\): y has dtype <U3.*np.unique"):
        LOOP.run(fl.data.arrays(x, y, 4, device=True))
