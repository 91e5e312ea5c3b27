"""Resuming from States a trainer cannot continue, saves it cannot find, and runs with
nothing left to train: each says what it is, and nothing the user had is lost."""

from __future__ import annotations

import numpy as np
import pytest

import fuseloop as fl


def _data() -> fl.data.ArraySource:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5)).astype(np.float32)
    y = rng.integers(0, 3, 24).astype(np.int32)
    return fl.data.arrays(x, y, batch_size=8)


def _trainer() -> fl.Loop:
    model = fl.models.mlp([8, 3])
    return fl.trainer(model, "sparse_categorical_cross_entropy", "adam").metric("accuracy")


def test_a_trainer_given_an_evaluators_state_names_init_state_and_the_fix():
    data, trainer = _data(), _trainer()
    trained = trainer.run(data, epochs=1)
    scored = fl.evaluator(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy").run(
        data, trained
    )
    with pytest.raises(ValueError, match=r"init_state: .*opt_state, rng, step.*state\.params"):
        trainer.run(data, scored, epochs=2)
    trainer.run(data, scored.params, epochs=1)  # the fix it names
    # A custom loop's State holds no params: it failed with KeyError('params') inside.
    custom = fl.loop(lambda batch, s: {"n": s["n"] + 1}).run(data, {"n": np.int32(0)})
    with pytest.raises(ValueError, match=r"holds \['n'\], not the params, .*afresh"):
        trainer.run(data, custom, epochs=2)
    # Ctrl-C while a run starts leaves a State without a step state (error.fuseloop_state).
    with pytest.raises(ValueError, match=r"init_state: this State holds no step state"):
        trainer.run(data, fl.State(), epochs=2)


def test_a_resume_from_an_iteration_handlers_state_in_a_fused_run_names_why(tmp_path):
    # Mid-chunk the step state is on the device: the handler's State has none, and its
    # resume once blamed only Ctrl-C.
    saved = []

    def save(state: fl.State) -> None:
        if state.iteration == 1 and not saved:
            saved.append(fl.save_state(state, tmp_path / "mid"))

    trainer = _trainer()
    trainer.handle_event("iteration_completed", save).run(_data(), epochs=1, fuse=3)
    with pytest.raises(ValueError, match=r"no step state.*iteration handler gets in a fused"):
        trainer.run(_data(), fl.load_state(saved[0]), epochs=2)


def test_loading_a_populations_best_checkpoint_folder_names_its_members(tmp_path):
    folder = tmp_path / "best"
    _trainer().checkpoint(folder, criteria="loss").run(_data(), epochs=2, population=2)
    with pytest.raises(ValueError, match=r"one folder per member \(member_0, member_1\)"):
        fl.load_state(folder)
    assert fl.load_state(folder / "member_0").history


def test_a_resume_with_nothing_left_to_train_keeps_the_metrics():
    data, trainer = _data(), _trainer()
    done = trainer.run(data, epochs=2)
    with pytest.warns(RuntimeWarning, match="nothing is trained"):
        again = trainer.run(data, done, epochs=2)
    assert again.metrics == done.metrics and again.history == done.history
