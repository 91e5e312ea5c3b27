"""Populations: early_stop(restore_best), reduce_lr_on_plateau and checkpoint(criteria=)
decide per member, each member as its solo run (engine/population_monitors.py)."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import fuseloop as fl
from conftest import tree_equal
from fuseloop.handlers.checkpoint import list_checkpoints
from test_population_members import _data, _leaves, _named_sgd, _trainer

RATES = [0.0, 0.05, 1.0]  # measured: different best epochs, stops and plateaus per member


def _close(a, b):
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _solo(rate, seed, build, **run):
    return build(_trainer(_named_sgd(rate), seed=seed)).run(_data(), **run)


# ----------------------------------------------------------------- early_stop(restore_best)
def _restoring(loop):
    return loop.early_stop("loss", patience=2, restore_best=True)


def test_restore_best_restores_each_members_best_epoch():
    data = _data()
    loop = _restoring(_trainer())
    pop = loop.run(data, epochs=10, fuse=4, population={"learning_rate": RATES})
    plain = loop.run(data, epochs=10, fuse=False, population={"learning_rate": RATES})
    assert tree_equal(pop.step_state, plain.step_state)
    best_epochs = []
    for i, rate in enumerate(RATES):
        solo = _solo(rate, i, _restoring, epochs=10, fuse=4)
        member = pop.member(i)
        _close(member.params, solo.params)
        assert int(member.step_state["step"]) == int(solo.step_state["step"])
        record = solo.handler_metadata["early_stop:loss"]
        assert member.handler_metadata["early_stop:loss"]["best_epoch"] == record["best_epoch"]
        # The same record's fields as its solo run's (no stopped epoch before it stops).
        assert member.handler_metadata.keys() - {"_population"} == solo.handler_metadata.keys()
        assert member.handler_metadata["early_stop:loss"].keys() == record.keys()
        best_epochs.append(record["best_epoch"])
        assert sorted(member.history) == sorted(solo.history)
    # Measured: member 2 stops two epochs after its best, member 1 runs to the end.
    assert len(set(best_epochs)) == 3
    assert any(b < max(pop.member(i).history) for i, b in enumerate(best_epochs))


@pytest.mark.parametrize("fuse", [False, 4])
def test_the_last_epochs_later_handlers_see_a_running_members_own_step_state(fuse):
    # Every member runs to the end, member 0 with its best at epoch 2: the handlers after
    # early_stop at the last epoch (a checkpoint) see that epoch's own step state, as its
    # solo run's do; the State the run returns holds the best epoch's.
    scores = [[5.0, 5.0, 5.0], [4.0, 4.0, 4.0], [1.0, 3.0, 3.0], [2.0, 2.0, 2.0], [3.0, 1.0, 1.0]]
    seen = {}

    def score(state):
        return "continue", state.replace(
            metrics={**state.metrics, "score": np.asarray(scores[state.epoch], np.float32)}
        )

    def keep(name):
        def handler(state):
            seen[(name, state.epoch)] = jax.tree.map(np.asarray, state.step_state)

        return handler

    loop = _trainer().handle_event("epoch_completed", score)
    loop = loop.handle_event("epoch_completed", keep("before"))
    loop = loop.early_stop("score", patience=5, restore_best=True)
    loop = loop.handle_event("epoch_completed", keep("after"))
    pop = loop.run(_data(), epochs=5, fuse=fuse, population={"learning_rate": RATES})
    assert pop.status == "completed"
    assert tree_equal(seen[("before", 4)], seen[("after", 4)])
    member_0 = jax.tree.map(lambda a: np.asarray(a)[0], pop.step_state)
    assert tree_equal(member_0, jax.tree.map(lambda a: a[0], seen[("after", 2)]))


def test_restore_best_when_another_handler_halts_the_run():
    data = _data()

    def halt_at_3(loop):
        stop = loop.handle_event("epoch_completed", lambda s: "halt_loop" if s.epoch == 3 else None)
        return _restoring(stop)

    loop = halt_at_3(_trainer())  # one Loop for both runs: it traces its programs once
    pop = loop.run(data, epochs=10, fuse=4, population={"learning_rate": RATES})
    plain = loop.run(data, epochs=10, fuse=False, population={"learning_rate": RATES})
    assert tree_equal(pop.step_state, plain.step_state)
    for i, rate in enumerate(RATES):
        solo = _solo(rate, i, halt_at_3, epochs=10, fuse=4)
        _close(pop.member(i).params, solo.params)
        assert int(pop.member(i).step_state["step"]) == int(solo.step_state["step"])


def test_restore_best_on_resume_keeps_the_best_epoch_its_state_holds(tmp_path):
    data = _data()
    population = {"learning_rate": [0.0, 0.05]}
    half = _restoring(_trainer()).run(data, epochs=2, fuse=4, population=population)
    fl.save_state(half, tmp_path / "p")
    fresh = _restoring(_trainer())  # a new handler: it holds no copy from the first run
    # Member 0's State holds its best epoch's step state (restored): the new handler takes
    # it, as a solo run's does (it was told the best ran in an earlier run).
    with pytest.warns(RuntimeWarning, match=r"member 0 holds epoch 0's step state") as caught:
        resumed = fresh.run(data, fl.load_state(tmp_path / "p"), epochs=4, fuse=4)
    assert not any("member 0's best epoch (0)" in str(w.message) for w in caught)
    assert resumed.member(0).handler_metadata["early_stop:loss"]["best_epoch"] == 0
    assert tree_equal(resumed.member(0).step_state, half.member(0).step_state)


# ----------------------------------------------------------------- reduce_lr_on_plateau
def _reducing(loop):
    return loop.reduce_lr_on_plateau("loss", factor=0.5, patience=1, min_delta=0.002)


def test_reduce_lr_per_member_matches_solo_schedules():
    data = _data()
    rates = [0.01, 0.3, 1.0]  # measured: 0, 1 and 2 reductions in 8 epochs
    loop = _reducing(_trainer())
    pop = loop.run(data, epochs=8, fuse=4, population={"learning_rate": rates})
    plain = loop.run(data, epochs=8, fuse=False, population={"learning_rate": rates})
    assert tree_equal(pop.step_state, plain.step_state)
    reductions = []
    for i, rate in enumerate(rates):
        solo = _solo(rate, i, _reducing, epochs=8, fuse=4)
        member = pop.member(i)
        assert [h["learning_rate"] for h in member.history.values()] == [
            h["learning_rate"] for h in solo.history.values()
        ]
        _close(member.params, solo.params)
        key = "reduce_lr_on_plateau:loss"
        reductions.append(member.handler_metadata[key]["reductions"])
        assert reductions[-1] == solo.handler_metadata[key]["reductions"]
    assert reductions == [0, 1, 2]


def test_reduce_lr_skips_halted_members():
    data = _data()
    loop = _reducing(_trainer().early_stop("loss", patience=1))
    pop = loop.run(data, epochs=8, fuse=4, population={"learning_rate": [0.0, 1.0]})
    member = pop.member(0)  # lr 0: stops at epoch 1, never reduced
    assert set(h["learning_rate"] for h in member.history.values()) == {0.0}
    solo = _solo(1.0, 1, lambda lp: _reducing(lp.early_stop("loss", patience=1)), epochs=8, fuse=4)
    assert [h["learning_rate"] for h in pop.member(1).history.values()] == [
        h["learning_rate"] for h in solo.history.values()
    ]


# ----------------------------------------------------------------- checkpoint(criteria=)
def test_checkpoint_on_best_saves_each_members_best(tmp_path):
    data = _data()
    rates = [0.01, 0.3, 1.0]  # measured: member 1 and 2 skip epochs without improvement

    def saving(path):
        return lambda loop: loop.checkpoint(str(path), criteria="loss")

    pop = saving(tmp_path / "pop")(_trainer()).run(
        data, epochs=6, fuse=4, population={"learning_rate": rates}
    )
    saving(tmp_path / "plain")(_trainer()).run(
        data, epochs=6, fuse=False, population={"learning_rate": rates}
    )
    assert not list((tmp_path / "pop").glob("checkpoint_*"))  # only per-member saves
    skipped = 0
    for i, rate in enumerate(rates):
        _solo(rate, i, saving(tmp_path / f"solo{i}"), epochs=6, fuse=4)
        mine = list_checkpoints(tmp_path / "pop" / f"member_{i}")
        theirs = list_checkpoints(tmp_path / f"solo{i}")
        assert [p.name for p in mine] == [p.name for p in theirs]
        skipped += 6 - len(mine)
        fused = fl.load_state(tmp_path / "pop" / f"member_{i}")
        plain = fl.load_state(tmp_path / "plain" / f"member_{i}")
        solo = fl.load_state(tmp_path / f"solo{i}")
        assert fused.population is None and fused.epoch == solo.epoch
        assert tree_equal(fused.step_state, plain.step_state)
        _close(fused.params, solo.params)
        assert sorted(fused.history) == sorted(solo.history)
        best = fused.handler_metadata["checkpoint:loss"]
        assert best["best_epoch"] == solo.handler_metadata["checkpoint:loss"]["best_epoch"]
    assert skipped > 0
    record = pop.handler_metadata["checkpoint:loss"]
    assert len(record["best"]) == 3  # the population keeps one entry per member


def test_checkpoint_on_best_asynchronous(tmp_path):
    loop = _trainer().checkpoint(str(tmp_path), criteria="loss", asynchronous=True, keep=1)
    loop.run(_data(), epochs=2, fuse=4, population=2)
    for i in range(2):
        assert len(list_checkpoints(tmp_path / f"member_{i}")) == 1
        assert fl.load_state(tmp_path / f"member_{i}").epoch == 1


def test_reduce_lr_cooldown_and_floor_per_member():
    def reducing(loop):
        return loop.reduce_lr_on_plateau(
            "loss", factor=0.5, patience=1, min_delta=0.05, cooldown=1, min_lr=0.2
        )

    rates = [0.3, 1.0]  # measured: member 0 is at the floor 0.2 from epoch 2, member 1 halves
    pop = reducing(_trainer()).run(_data(), epochs=6, fuse=4, population={"learning_rate": rates})
    for i, rate in enumerate(rates):
        solo = _solo(rate, i, reducing, epochs=6, fuse=4)
        assert [h["learning_rate"] for h in pop.member(i).history.values()] == [
            h["learning_rate"] for h in solo.history.values()
        ]
    assert min(pop.history[5]["learning_rate"]) >= np.float32(0.2)


def _scored(scores):
    """A population trainer whose epochs score `scores[epoch]` (one column per member),
    watched by early_stop(restore_best=True) with patience to spare."""

    def score(state):
        return "continue", state.replace(metrics={**state.metrics, "score": scores[state.epoch]})

    scored = _trainer().handle_event("epoch_completed", score)
    return scored.early_stop("score", patience=5, restore_best=True)


POPULATION = {"learning_rate": [0.05, 0.1]}


def test_a_members_best_epoch_that_ended_the_saved_run_is_restored_after_a_resume(tmp_path):
    # Member 0's best is epoch 2, the saved run's last; member 1 improves.
    scores = np.array([[3.0, 3.0], [2.0, 2.0], [1.0, 1.0], [5.0, 0.5], [6.0, 0.2]])
    half = _scored(scores).run(_data(), epochs=3, fuse=4, population=POPULATION)
    fl.save_state(half, tmp_path / "p")
    resumed = _scored(scores).run(_data(), fl.load_state(tmp_path / "p"), epochs=5, fuse=4)
    # As a solo run resumed from its best epoch's own State: it holds that step state.
    kept = _leaves(half.member(0).params)
    for got, want in zip(_leaves(resumed.member(0).params), kept, strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(resumed.member(1).step_state["step"]) == 40  # member 1 trained on to epoch 4


def test_a_resume_from_members_holding_an_earlier_best_epoch_keeps_it_as_a_solo_one(tmp_path):
    # Member 0's best is epoch 0, member 1's the last; nobody stops. Resumed in a new Loop,
    # member 0 keeps the best epoch's step state its State holds, as its solo run does (it
    # was told its best ran in an earlier run, and kept its last epoch's).
    scores = np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0], [4.0, 0.5], [5.0, 0.2]])
    half = _scored(scores).run(_data(), epochs=3, fuse=4, population=POPULATION)
    # Member 0 holds epoch 0's weights, as its solo run's State says of itself.
    assert half.member(0).handler_metadata["_restored_best_epoch"] == 0
    assert "_restored_best_epoch" not in half.member(1).handler_metadata  # as in its solo run
    fl.save_state(half, tmp_path / "p")
    with pytest.warns(RuntimeWarning, match=r"member 0 holds epoch 0's step state") as caught:
        resumed = _scored(scores).run(_data(), fl.load_state(tmp_path / "p"), epochs=5, fuse=4)
    assert not any("ran in an earlier" in str(w.message) for w in caught)
    assert resumed.member(1).handler_metadata.get("_restored_best_epoch") is None
    assert resumed.member(0).handler_metadata["_restored_best_epoch"] == 0
    assert tree_equal(resumed.member(0).params, half.member(0).params)


def test_a_stopped_members_solo_state_notes_its_restored_best_epoch_as_a_solo_run(tmp_path):
    # Member 0 improves until epoch 1 and stops at epoch 3 (patience 2); member 1 improves.
    scores = np.array([[3.0, 3.0], [1.0, 2.0], [2.0, 1.0], [2.5, 0.5], [4.0, 0.2], [5.0, 0.1]])

    def stopping(loop, column=slice(None)):  # a solo run scores as member `column`
        def score(state):
            return "continue", state.replace(
                metrics={**state.metrics, "score": scores[state.epoch][column]}
            )

        return loop.handle_event("epoch_completed", score).early_stop(
            "score", patience=2, restore_best=True
        )

    pop = stopping(_trainer()).run(_data(), epochs=5, fuse=4, population=POPULATION)
    member = pop.member(0)
    assert member.status == "halted" and max(member.history) == 3
    assert member.handler_metadata["_restored_best_epoch"] == 1  # as its solo State says
    assert "_restored_best_epoch" not in pop.member(1).handler_metadata
    # Its solo State holds its best epoch's step state, which a solo run resumed from it
    # (in another Loop) keeps as the best: it was told the best ran in an earlier run.
    with pytest.warns(RuntimeWarning, match=r"holds epoch 1's step state") as caught:
        solo = stopping(_trainer(), column=0).run(_data(), member, epochs=5, fuse=4)
    assert not any("ran in an earlier run" in str(w.message) for w in caught)
    assert tree_equal(solo.step_state, member.step_state)
    with warnings.catch_warnings():  # the population resumed: member 0 stays frozen
        warnings.filterwarnings("error", message=".*holds epoch")
        stopping(_trainer()).run(_data(), pop, epochs=6, fuse=4)


def test_a_member_that_stops_after_a_resume_restores_the_best_its_state_held(tmp_path):
    # Member 0's best is epoch 0 (in the saved run, whose State holds that epoch's step
    # state); it stops at epoch 5 of the resumed run (in another Loop) and gets it back.
    scores = np.array([[1.0 + e, 3.0 - 0.1 * e] for e in range(8)])
    half = _scored(scores).run(_data(), epochs=3, fuse=4, population=POPULATION)
    assert half.member(0).handler_metadata["_restored_best_epoch"] == 0
    with pytest.warns(RuntimeWarning) as caught:
        resumed = _scored(scores).run(_data(), half, epochs=8, fuse=4)
    assert not any("ran in an earlier" in str(w.message) for w in caught)
    assert resumed.member(0).handler_metadata["_restored_best_epoch"] == 0
    assert tree_equal(resumed.member(0).step_state, half.member(0).step_state)
