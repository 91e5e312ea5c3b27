"""Runs that reuse one resident source: the epoch orders a whole run keeps beside the source
(so a later run launches no program for them) give every run the unfused run's result.
"""

from __future__ import annotations

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
