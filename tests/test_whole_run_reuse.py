"""Runs that reuse one resident source, or sweep its seed: the epoch orders a whole run
keeps beside the source (so a later run launches no program for them) give every run the
unfused run's result; a new seed compiles nothing; the dispatches of runs split by their
handlers, and a device plateau's dispatches of `fuse=K`, share a few programs.
"""

from __future__ import annotations

import optax
import pytest

import fuseloop as fl
from fuseloop.engine import device_checkpoint
from test_compile import jax_compiles
from test_whole_run import EPOCHS, _assert_same_run, _data, _trainer, _validated, _xy


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


@pytest.mark.parametrize("fuse", ["run", 4])
def test_a_sweep_over_shuffle_seeds_compiles_nothing_after_its_first_seed(fuse):
    # The seed reaches the order programs as an input, not as a constant of their code.
    x, y = _xy()

    def data(seed: int) -> object:
        return fl.data.arrays(x, y, batch_size=16, device=True, seed=seed)

    loop = _trainer()
    first = loop.run(data(1), epochs=3, fuse=fuse)
    with jax_compiles() as compiled:
        swept = loop.run(data(7), epochs=3, fuse=fuse)
    assert compiled == []
    _assert_same_run(swept, _trainer().run(data(7), epochs=3))
    assert swept.history != first.history


def test_dispatches_of_a_split_run_and_runs_of_other_lengths_share_few_programs(
    tmp_path, monkeypatch
):
    # A ring of one state: every improvement of the loss ends the dispatch after its epoch,
    # so an 8-epoch run is 8 dispatches of 8, 7, ..., 1 epochs. The first compiles a program
    # of 8 segment slots, and the shorter ones take it (unused slots run nothing): 1 compile.
    monkeypatch.setattr(device_checkpoint, "RING_BUDGET_BYTES", 1)
    loop = _trainer().checkpoint(str(tmp_path / "a"), criteria="loss")
    split = loop.run(_data(), epochs=8, fuse="run")
    assert split.stats["dispatches"] == 8 and split.stats["compiles"] == 1
    plain = _trainer().checkpoint(str(tmp_path / "b"), criteria="loss").run(_data(), epochs=8)
    _assert_same_run(split, plain)
    # A run of 6 epochs (6, 5, ..., 1 left) finds every program it needs.
    shorter = loop.run(_data(), epochs=6, fuse="run")
    assert shorter.stats["dispatches"] == 6 and shorter.stats["compiles"] == 0


def test_a_device_plateau_compiles_one_program_for_every_dispatch_of_fuse_k():
    # 10 epochs of 6 steps in dispatches of 19: the last one is shorter (3 steps, one
    # segment). The plateau's table of rates is sized by the program's segment slots, not
    # the dispatch's segments, so the short dispatch runs the same program.
    def plateau() -> fl.Loop:
        vx, vy = _xy(seed=5, n=48)
        model = fl.models.mlp([8, 3])
        val = fl.data.arrays(vx, vy, batch_size=16, device=True)
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.3)
        loop = fl.trainer(model, "sparse_categorical_cross_entropy", tx).validate(model, val)
        return loop.reduce_lr_on_plateau("validation_loss", factor=0.5, patience=1)

    fused = plateau().run(_data(), epochs=10, fuse=19)
    assert fused.stats["dispatches"] == 4 and fused.stats["compiles"] == 1
    _assert_same_run(fused, plateau().run(_data(), epochs=10))


def test_a_resumed_whole_run_takes_the_program_compiled_for_more_epochs():
    # 3 epochs compile a program of 4 segment slots; resumed to 5, the 2 epochs left run on
    # it (no compile), count their own steps, and end as the uninterrupted run.
    data, loop = _data(), _trainer()
    first = loop.run(data, epochs=3, fuse="run")
    steps_per_epoch = first.stats["chunk_size"] // 3
    resumed = loop.run(data, first, epochs=5, fuse="run")
    assert resumed.stats["compiles"] == 0 and resumed.stats["dispatches"] == 1
    assert resumed.stats["chunk_size"] == 2 * steps_per_epoch
    _assert_same_run(resumed, _trainer().run(_data(), epochs=5))


def test_runs_of_other_iteration_bounds_take_the_program_of_the_first():
    # The bound is the program's input: runs of 5, 3 and 6 steps an epoch, many epochs per
    # dispatch, compile one program between them, each the unfused run of its bound.
    data, loop = _data(), _validated(patience=3)
    loop.run(data, epochs=3, fuse="run")  # the full epochs' program
    compiles = []
    for bound in (5, 3, 6):
        with jax_compiles() as compiled:
            bounded = loop.run(data, epochs=3, fuse="run", iterations=bound)
        compiles.append(len(compiled))
        assert bounded.stats["whole_run"] and (bounded.epoch, bounded.iteration) == (2, bound - 1)
        _assert_same_run(bounded, _validated(patience=3).run(_data(), epochs=3, iterations=bound))
    assert compiles == [0, 0, 0]
