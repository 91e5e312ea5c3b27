"""Resuming from a State taken inside an epoch, and checkpoint paths a user gets wrong: the
resumed run keeps the uninterrupted run's counts (so `every=` schedules), says where it
cannot continue it exactly, and no save is read in place of the latest checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

import fuseloop as fl
from conftest import make_batches, trainer
from fuseloop.handlers.checkpoint import list_checkpoints

_BATCHES = make_batches(4)
_X = np.concatenate([b[0] for b in _BATCHES])
_Y = np.concatenate([b[1] for b in _BATCHES])


def _data() -> object:
    return fl.data.arrays(_X, _Y, batch_size=len(_BATCHES[0][1]), seed=1)


def test_a_checkpoint_taken_mid_epoch_warns_and_the_resumed_run_keeps_the_counts(tmp_path):
    loop = trainer()
    full = loop.run(_data(), epochs=3)
    every = loop.checkpoint(tmp_path, event="iteration_completed", filter={"every": 3})
    every.run(_data(), epochs=2)
    saved = fl.load_state(tmp_path)  # the 7th iteration's (1, 4, 7): still running
    assert (saved.status, saved.epoch, saved.iteration) == ("running", 1, 2)
    with pytest.warns(
        RuntimeWarning, match=r"inside epoch 1 \(status 'running'\) after stepping 3"
    ):
        resumed = loop.run(_data(), saved, epochs=3)
    assert resumed.event_counts == full.event_counts


def test_a_run_resumed_from_its_epoch_started_checkpoint_keeps_the_schedule(tmp_path):
    def crash_in_epoch_4(state: fl.State) -> None:
        if state.epoch == 4:
            raise KeyError("preempted")

    def saving(directory: object) -> fl.Loop:
        return trainer().checkpoint(directory, event="epoch_started", filter={"every": 3})

    full = saving(tmp_path / "full").run(_data(), epochs=7)
    with pytest.raises(KeyError, match="preempted"):
        saving(tmp_path / "cut").handle_event("epoch_completed", crash_in_epoch_4).run(
            _data(), epochs=7
        )
    saved = fl.load_state(tmp_path / "cut")  # taken at epoch 3's start
    resumed = saving(tmp_path / "cut").run(_data(), saved, epochs=7)
    assert resumed.event_counts == full.event_counts
    epochs = [path.name.rsplit("_", 1)[1] for path in list_checkpoints(tmp_path / "cut")]
    assert epochs == ["0", "3", "3", "6"]  # epoch 3 started twice; epoch 6 as uninterrupted


def test_a_checkpoint_directory_that_is_a_save_or_under_a_file_is_refused(tmp_path):
    saved = fl.save_state(trainer().run(_BATCHES), tmp_path / "save")
    with pytest.raises(ValueError, match=r"is a save written by fl.save_state, not a checkp"):
        trainer().checkpoint(saved)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"is a file, so no save can be made there"):
        fl.save_state(fl.load_state(saved), tmp_path / "a_file" / "save")
