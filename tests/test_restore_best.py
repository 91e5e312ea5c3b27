"""`early_stop(..., restore_best=True)`: the run ends with the best epoch's step state."""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import make_batches
from fuseloop.handlers.monitor import EarlyStopping

DATA = make_batches(6)
SPARSE = "sparse_categorical_cross_entropy"


def attach(loop, stopper):
    """What `Loop.early_stop(..., restore_best=True)` attaches: `handle_event` adds the
    handler's start and end (`EarlyStopping.fuseloop_companions`)."""
    return loop.handle_event("epoch_completed", stopper, name="early_stop")


@functools.cache
def base_trainer():
    """The trainer every test here runs (mlp-[4, 3] with adam(0.05)); the tests add only
    handlers to it, so they share its compiled programs (traced and lowered once)."""
    return fl.trainer(fl.models.mlp([4, 3]), SPARSE, optax.adam(0.05))


@functools.cache
def snapshots(fuse):
    """Each epoch's step state (host copies) from a run without early stopping: computed
    once per `fuse` (a scripted score is only a metric: the step states do not depend on
    it). Read only."""
    kept = {}

    def keep(state):
        kept[state.epoch] = jax.tree.map(np.asarray, state.step_state)

    base_trainer().handle_event("epoch_completed", keep).run(DATA, epochs=8, fuse=fuse)
    return kept


def scripted_metric(values):
    """A handler that writes a scripted "score" each epoch (so the best epoch is known)."""

    def write(state):
        return "continue", state.replace(metrics={**state.metrics, "score": values[state.epoch]})

    return write


def scripted_trainer(values):
    """The trainer these tests run: mlp-[4, 3] with adam(0.05), scoring epochs by `values`."""
    return base_trainer().handle_event("epoch_completed", scripted_metric(values))


@pytest.mark.parametrize("fuse", [False, 3])
@pytest.mark.parametrize(
    "values, epochs, best",
    [
        ([5, 3, 1, 2, 4, 6, 7, 8], 8, 2),  # halts at epoch 4 (patience 2), best epoch 2
        ([5, 4, 3, 2, 1.5, 1.7, 1.6, 1.8], 6, 4),  # runs to the end, best epoch 4
    ],
)
def test_restore_best_step_state_bitwise(fuse, values, epochs, best):
    def factory():
        return scripted_trainer(values)

    kept = snapshots(fuse)
    stopper = EarlyStopping("score", patience=2, restore_best=True)
    state = attach(factory(), stopper).run(DATA, epochs=epochs, fuse=fuse)
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, state.step_state), kept[best]
    )
    np.testing.assert_array_equal(
        np.asarray(state.params["params"]["Dense_0"]["kernel"]),
        kept[best]["params"]["params"]["Dense_0"]["kernel"],
    )


def test_default_keeps_the_last_epoch():
    values = [5, 3, 1, 2, 4, 6, 7, 8]

    def factory():
        return scripted_trainer(values)

    kept = snapshots(False)
    state = attach(factory(), EarlyStopping("score", patience=2)).run(DATA, epochs=6)
    assert state.epoch == 4
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.step_state), kept[4])


def test_restore_best_is_validated():
    with pytest.raises(ValueError, match="restore_best"):
        EarlyStopping("loss", restore_best="yes")


@pytest.mark.parametrize("fuse", [False, 3])
@pytest.mark.parametrize(
    ("values", "epochs"), [([5, 3, 1, 2, 4, 6, 7, 8], 6), ([5, 4, 3, 3.5, 4, 4, 4, 4], 4)]
)
def test_a_checkpoint_after_it_holds_its_epochs_own_step_state(tmp_path, fuse, values, epochs):
    # The stopping epoch (4) and a last epoch (3): the checkpoint attached after early_stop
    # saves that epoch's step state under that epoch's name; only the State the run
    # returns holds the best epoch's.
    def factory():
        return scripted_trainer(values)

    kept = snapshots(fuse)
    loop = factory().early_stop("score", patience=2, restore_best=True).checkpoint(tmp_path)
    state = loop.run(DATA, epochs=epochs, fuse=fuse)
    last = max(state.history)
    saved = fl.load_state(str(sorted(tmp_path.iterdir())[-1]))
    assert saved.epoch == last
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, saved.step_state), kept[last]
    )
    best = state.handler_metadata["early_stop:score"]["best_epoch"]
    assert best != last
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, state.step_state), kept[best]
    )


@pytest.mark.parametrize("fuse", [False, 3])
@pytest.mark.parametrize("resume_from", [2, 3])
def test_a_run_resumed_from_its_best_or_a_later_epoch_ends_as_the_uninterrupted_one(
    tmp_path, fuse, resume_from
):
    # Best epoch 2, halted at 4. Resumed from epoch 2's checkpoint, the run holds the best
    # step state from its start; resumed from epoch 3's, the best ran in an earlier run and
    # the State keeps the last epoch's, with a warning.
    values = [5, 3, 1, 2, 4, 6, 7, 8]

    def loop(directory):
        return (
            scripted_trainer(values)
            .early_stop("score", patience=2, restore_best=True)
            .checkpoint(directory)
        )

    whole = loop(tmp_path / "whole").run(DATA, epochs=8, fuse=fuse)
    saves = fl.handlers.checkpoint.list_checkpoints(tmp_path / "whole")
    resumed_from = fl.load_state(saves[resume_from])
    assert resumed_from.epoch == resume_from
    if resume_from == 2:
        resumed = loop(tmp_path / "again").run(DATA, resumed_from, epochs=8, fuse=fuse)
        assert jax.tree.all(jax.tree.map(np.array_equal, resumed.step_state, whole.step_state))
    else:
        with pytest.warns(RuntimeWarning, match=r"best epoch \(2\) ran in an earlier run"):
            resumed = loop(tmp_path / "again").run(DATA, resumed_from, epochs=8, fuse=fuse)
    assert (resumed.epoch, resumed.status) == (whole.epoch, whole.status) == (4, "halted")


def test_a_run_continuing_the_last_one_in_the_same_loop_keeps_its_best_copy():
    # As in a notebook: run, then run on from the returned State with the same Loop. No
    # later epoch improves, so the best is still epoch 2's, which this process holds.
    values = [5, 3, 1, 2, 4, 6, 7, 8]

    def factory():
        return scripted_trainer(values)

    kept = snapshots(False)
    loop = factory().early_stop("score", patience=10, restore_best=True)
    first = loop.run(DATA, epochs=4)
    # `first` holds epoch 2's step state: epochs 4 and 5 train on from it, as it says,
    # its optimizer state too (unlike Keras's restore_best_weights: the warning says so).
    with pytest.warns(
        RuntimeWarning,
        match=r"holds epoch 2's step state.*its optimizer state too.*restores the weights alone",
    ):
        later = loop.run(DATA, first, epochs=6)
    for state in (first, later):
        jax.tree.map(
            np.testing.assert_array_equal, jax.tree.map(np.asarray, state.step_state), kept[2]
        )


def test_another_runs_best_copy_is_never_restored_into_a_resume():
    # One Loop, two runs of the same scripted curve (the same best epoch and value): the
    # copy the handler holds is the second run's, so a resume of the first must not take
    # it; it keeps its own best, the step state `first` holds (restored to epoch 1).
    values = [5, 3, 4, 6, 7, 8]
    loop = scripted_trainer(values).early_stop("score", patience=10, restore_best=True)
    first = loop.run(DATA, epochs=3)
    second = loop.run(list(reversed(DATA)), epochs=3)  # other batches: other weights
    assert first.handler_metadata["early_stop:score"] == second.handler_metadata["early_stop:score"]
    with pytest.warns(RuntimeWarning, match=r"holds epoch 1's step state") as caught:
        resumed = loop.run(DATA, first, epochs=4)
    assert not any("ran in an earlier run" in str(w.message) for w in caught)
    leaves = lambda s: jax.tree.leaves(jax.tree.map(np.asarray, s.step_state))  # noqa: E731
    assert not all(
        np.array_equal(a, b) for a, b in zip(leaves(resumed), leaves(second), strict=True)
    )
    assert all(np.array_equal(a, b) for a, b in zip(leaves(resumed), leaves(first), strict=True))


def test_a_handler_that_replaces_the_restored_step_state_drops_the_note_of_its_epoch():
    """A `completed` handler after early_stop's restore that swaps the step state (averaged
    weights): the State noted the best epoch still, and a resume in another Loop took the
    swapped weights for that epoch's."""
    values = [5, 3, 4, 6]  # best epoch 1, restored at the end

    def averaged(state):  # any other step state than the restored one
        halved = jax.tree.map(lambda a: a * 0 if a.dtype.kind == "f" else a, state.step_state)
        return "continue", state.replace(step_state=halved)

    loop = scripted_trainer(values).early_stop("score", patience=10, restore_best=True)
    assert loop.run(DATA, epochs=3).handler_metadata["_restored_best_epoch"] == 1
    swapped = loop.handle_event("completed", averaged).run(DATA, epochs=3)
    assert "_restored_best_epoch" not in swapped.handler_metadata


def test_a_restored_state_resumed_in_another_loop_keeps_its_best_step_state(tmp_path):
    """A notebook restarts: the State a restoring run returned, saved and loaded into a new
    Loop, holds its best epoch's step state; the resumed run that finds no better epoch
    returns it, as the same Loop does (it returned the last epoch's and said the best ran in
    an earlier run). A later epoch's State does not claim to hold it."""
    values = [5, 3, 4, 6, 7, 8]  # best epoch 1

    def loop():
        return scripted_trainer(values).early_stop("score", patience=10, restore_best=True)

    first = loop().run(DATA, epochs=3)
    assert first.handler_metadata["_restored_best_epoch"] == 1
    fl.save_state(first, tmp_path / "first")
    for fuse in (False, 2):
        with pytest.warns(RuntimeWarning, match=r"holds epoch 1's step state") as caught:
            resumed = loop().run(DATA, fl.load_state(tmp_path / "first"), epochs=5, fuse=fuse)
        assert not any("ran in an earlier run" in str(w.message) for w in caught)
        jax.tree.map(
            np.testing.assert_array_equal,
            jax.tree.map(np.asarray, resumed.step_state),
            jax.tree.map(np.asarray, first.step_state),
        )
        assert resumed.handler_metadata["_restored_best_epoch"] == 1
    epochs_seen = []

    def note(state):
        epochs_seen.append(state.handler_metadata.get("_restored_best_epoch"))

    loop().handle_event("epoch_completed", note).run(DATA, first, epochs=5)
    assert epochs_seen == [None, None]  # epochs 3 and 4 step on: their own step states


def test_a_population_resumed_after_another_run_of_its_loop_starts():
    # A population's history holds one value per member (arrays): telling the State the
    # last run ended with from another must not compare them.
    loop = base_trainer().early_stop("loss", patience=5, restore_best=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = loop.run(DATA, epochs=2, population=2)
        loop.run(DATA, epochs=2, population=2)
        resumed = loop.run(DATA, first, epochs=3)
    assert sorted(resumed.history) == [0, 1, 2]


def test_a_second_stopper_on_the_same_record_key_is_refused():
    loop = scripted_trainer([1, 2]).early_stop("score", patience=3)
    with pytest.raises(ValueError, match=r"handler_metadata\['early_stop:score'\].*key="):
        loop.handle_event("epoch_completed", EarlyStopping("score", patience=6))
    own_key = EarlyStopping("score", patience=6, key="early_stop:score#6")
    loop.handle_event("epoch_completed", own_key)  # its own record: accepted


def test_resuming_from_a_state_holding_an_earlier_epochs_weights_warns():
    values = [0.1, 0.5, 0.9]  # the best epoch is the first; the State holds its weights
    loop = scripted_trainer(values + [1.0]).early_stop("score", patience=5, restore_best=True)
    state = loop.run(DATA, epochs=3)
    assert state.handler_metadata["_restored_best_epoch"] == 0
    with pytest.warns(RuntimeWarning, match=r"holds epoch 0's step state .* runs to epoch 2"):
        loop.run(DATA, state, epochs=4)
    # Ending on its best epoch, the State is the last epoch's own: nothing to warn of.
    rising = scripted_trainer([0.9, 0.5, 0.1, 0.0]).early_stop("score", restore_best=True)
    last = rising.run(DATA, epochs=3)
    assert "_restored_best_epoch" not in last.handler_metadata
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rising.run(DATA, last, epochs=4)


def test_a_run_halted_inside_the_epoch_after_its_best_resumes_without_a_false_warning():
    """terminate_on_nan halts inside epoch 1; restore_best hands back epoch 0's end, from
    which a resumed run starts epoch 1 cleanly. Resuming warned that the batches already
    stepped would train twice."""
    epochs_served = []

    def data():
        epochs_served.append(len(epochs_served))
        if len(epochs_served) != 2:
            return iter(DATA)
        bad = (DATA[1][0] * np.nan, DATA[1][1])
        return iter([DATA[0], bad, *DATA[2:]])

    loop = base_trainer().early_stop("loss", patience=3, restore_best=True).terminate_on_nan()
    with pytest.warns(RuntimeWarning, match="non-finite at epoch 1, iteration 1"):
        halted = loop.run(data, epochs=3)
    assert (halted.status, halted.epoch, sorted(halted.history)) == ("halted", 1, [0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = loop.run(data, halted, epochs=3)
    assert resumed.status == "completed" and sorted(resumed.history) == [0, 1, 2]


@pytest.mark.parametrize("fuse", [False, "run"])
def test_the_best_step_state_is_kept_by_one_copy_program_not_one_per_leaf_shape(fuse):
    # Leaf shapes no other test makes: an eager copy per leaf would compile one per shape.
    from test_compile import jax_compiles

    x = np.random.default_rng(3).normal(size=(48, 5)).astype(np.float32)
    data = fl.data.arrays(x, (x[:, 0] > 0).astype(np.int32), batch_size=8, device=True)
    hidden = 11 if fuse is False else 17
    model = fl.models.mlp([hidden, hidden + 2, 2])
    loop = fl.trainer(model, "sparse_categorical_cross_entropy", optax.adam(1e-2))
    loop = loop.early_stop("loss", patience=5, restore_best=True)
    with jax_compiles() as compiled:
        state = loop.run(data, epochs=3, fuse=fuse)
    assert state.status == "completed"
    copies = [name for name in compiled if "copy" in name]
    assert len(copies) <= 1, compiled
