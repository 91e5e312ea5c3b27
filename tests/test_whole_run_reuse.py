"""Runs that reuse one resident source: the epoch orders a whole run keeps beside the source
(so a later run launches no program for them) give every run the unfused run's result; the
dispatches of runs split by their handlers share a few programs.
"""

from __future__ import annotations

from fuseloop.engine import device_checkpoint
from test_whole_run import EPOCHS, _assert_same_run, _data, _trainer, _validated


def test_repeated_and_resumed_runs_on_one_source_are_each_the_unfused_run():
    data, loop = _data(), _validated(patience=3)
    plain = _validated(patience=3).run(_data(), epochs=EPOCHS)
    for _ in range(2):
        _assert_same_run(loop.run(data, epochs=EPOCHS, fuse="run"), plain)
    middle = _trainer().run(_data(), epochs=2)
    resumed = _trainer().run(data, middle, epochs=EPOCHS, fuse="run")
    _assert_same_run(resumed, _trainer().run(_data(), middle, epochs=EPOCHS))
    again = loop.run(data, epochs=EPOCHS, fuse="run")
    _assert_same_run(again, plain)
    assert again.stats["compiles"] == 0 and again.stats["dispatches"] == 1


def test_dispatches_of_a_split_run_and_runs_of_other_lengths_share_few_programs(
    tmp_path, monkeypatch
):
    # A ring of one state: every improvement of the loss ends the dispatch after its epoch,
    # so an 8-epoch run is 8 dispatches of 8, 7, ..., 1 epochs. Their programs have 8, 4,
    # 2 and 1 segment slots (each count rounded up to a power of two): 4 compiles, not 8.
    monkeypatch.setattr(device_checkpoint, "RING_BUDGET_BYTES", 1)
    loop = _trainer().checkpoint(str(tmp_path / "a"), criteria="loss")
    split = loop.run(_data(), epochs=8, fuse="run")
    assert split.stats["dispatches"] == 8 and split.stats["compiles"] == 4
    plain = _trainer().checkpoint(str(tmp_path / "b"), criteria="loss").run(_data(), epochs=8)
    _assert_same_run(split, plain)
    # A run of 6 epochs (6, 5, ..., 1 left) finds every program it needs.
    shorter = loop.run(_data(), epochs=6, fuse="run")
    assert shorter.stats["dispatches"] == 6 and shorter.stats["compiles"] == 0
