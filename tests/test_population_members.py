"""Populations: per-member hyperparameters, per-member halting, checkpoint and resume."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import tree_equal
from fuseloop._optim import in_float32


def _leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _data(n=64, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.rand(n, 6).astype(np.float32)
    y = (x.sum(axis=1) > 3).astype(np.int32)
    return fl.data.arrays(x, y, batch_size=8)


def _named_sgd(learning_rate):
    """What the named "sgd" builds, with its rate given (a solo run of one member)."""
    injected = optax.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.float32)
    return in_float32(injected(learning_rate=learning_rate))


def _trainer(optimizer="sgd", seed=0):
    return fl.trainer(
        fl.models.mlp([16, 2]), "sparse_categorical_cross_entropy", optimizer, seed=seed
    )


# ----------------------------------------------------------------- hyperparameters
def test_learning_rate_sweep_matches_solo_runs():
    data = _data()
    rates = [0.01, 0.1, 0.5]
    pop = _trainer().run(data, epochs=2, fuse=4, population={"learning_rate": rates})
    np.testing.assert_allclose(pop.metrics["learning_rate"], rates, rtol=1e-7)
    # 0-d arrays stand for numbers (list(jnp.logspace(...)) gives them): they were refused.
    zero_d = [np.asarray(rates[0]), jnp.asarray(rates[1]), np.float32(rates[2])]
    again = _trainer().run(data, epochs=2, fuse=4, population={"learning_rate": zero_d})
    np.testing.assert_allclose(again.metrics["learning_rate"], rates, rtol=1e-7)
    for i, rate in enumerate(rates):
        solo = _trainer(_named_sgd(rate), seed=i).run(data, epochs=2, fuse=4)
        for a, b in zip(_leaves(pop.member(i).params), _leaves(solo.params), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_seeds_and_hyperparameters_together():
    data = _data()
    pop = _trainer("adam", seed=9).run(
        data, epochs=1, population={"seed": [3, 1], "b1": [0.8, 0.95]}
    )
    record = pop.handler_metadata["_population"]
    assert record["seeds"] == [3, 1]
    assert record["hyperparams"] == {"b1": [0.8, 0.95]}
    solo = _trainer(
        in_float32(
            optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(
                learning_rate=1e-3, b1=0.95
            )
        ),
        seed=1,
    ).run(data, epochs=1)
    for a, b in zip(_leaves(pop.member(1).params), _leaves(solo.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_population_dict_errors():
    data = _data()
    loop = _trainer()
    with pytest.raises(ValueError, match=r"learning_rate: 2, seed: 3"):
        loop.run(data, population={"learning_rate": [0.1, 0.2], "seed": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"'momentum_x'.*accepted: seed, learning_rate"):
        loop.run(data, population={"momentum_x": [0.1, 0.2]})
    plain = _trainer(optax.sgd(0.1))  # not injected: only seeds vary
    with pytest.raises(ValueError, match=r"accepted: seed \("):
        plain.run(data, population={"learning_rate": [0.1, 0.2]})
    assert plain.run(data, population={"seed": [0, 1]}).population == 2
    assert plain.run(data, population={"seed": range(2)}).population == 2


# ----------------------------------------------------------------- per-member halting
def _stopping(optimizer="sgd", seed=0, **kwargs):
    return _trainer(optimizer, seed).early_stop("loss", **kwargs)


def test_each_member_stops_at_its_solo_epoch():
    data = _data()
    rates = [0.0, 0.05, 1.0]  # measured: their solo runs halt at epochs 1, 8 and 3
    kwargs = {"patience": 1}
    loop = _stopping(**kwargs)
    pop = loop.run(data, epochs=10, fuse=4, population={"learning_rate": rates})
    plain = loop.run(data, epochs=10, fuse=False, population={"learning_rate": rates})
    assert tree_equal(pop.step_state, plain.step_state)
    record = pop.handler_metadata["_population"]
    lasts = []
    for i, rate in enumerate(rates):
        solo = _stopping(_named_sgd(rate), seed=i, **kwargs).run(data, epochs=10, fuse=4)
        member = pop.member(i)
        assert sorted(member.history) == sorted(solo.history), i
        assert member.status == solo.status
        assert int(member.step_state["step"]) == int(solo.step_state["step"])
        assert member.history[max(member.history)]["loss"] == pytest.approx(
            solo.history[max(solo.history)]["loss"], rel=1e-5
        )
        lasts.append(max(solo.history))
    assert len(set(lasts)) > 1, "the members should halt at different epochs"
    stopped = [last if last < 9 else None for last in lasts]
    assert [
        e if h else None for e, h in zip(record["last_epoch"], record["halted"], strict=True)
    ] == stopped
    # Later epochs show NaN for a halted member.
    first = min(lasts)
    if first + 1 in pop.history:
        assert np.isnan(pop.history[first + 1]["loss"][lasts.index(first)])


def test_run_ends_when_every_member_has_stopped():
    data = _data()
    # min_delta: at a rate of 0 the weights stay, but each epoch's mean loss sums its
    # examples in another order, which moves its last bit on some CPUs.
    stopping = _stopping(patience=1, min_delta=1e-4)
    pop = stopping.run(data, epochs=20, population={"learning_rate": [0.0, 0.0]})
    assert pop.status == "halted"
    assert sorted(pop.history) == [0, 1]


def test_terminate_on_nan_per_member():
    data = _data()
    rates = [0.05, 1e30]
    loop = _trainer().terminate_on_nan()
    with pytest.warns(RuntimeWarning, match=r"members \[1\]"):
        pop = loop.run(data, epochs=3, fuse=4, population={"learning_rate": rates})
    with pytest.warns(RuntimeWarning):
        plain = loop.run(data, epochs=3, fuse=False, population={"learning_rate": rates})
    assert tree_equal(pop.step_state, plain.step_state)
    assert pop.status == "completed"
    for i, rate in enumerate(rates):
        with pytest.warns() if rate > 1 else _nothing():
            solo = _trainer(_named_sgd(rate), seed=i).terminate_on_nan().run(data, epochs=3, fuse=4)
        member = pop.member(i)
        assert sorted(member.history) == sorted(solo.history)
        assert member.status == solo.status
        assert int(member.step_state["step"]) == int(solo.step_state["step"])


def _nan_in_epoch_1(data):
    """A source whose second epoch (epoch 1) holds a NaN input in its third batch."""
    calls = []

    def epoch():
        calls.append(None)
        if len(calls) != 2:
            return iter(data)
        return iter([(x * np.nan, y) if i == 2 else (x, y) for i, (x, y) in enumerate(data)])

    return epoch


def test_a_member_halted_by_a_nan_inside_an_epoch_is_in_that_epoch_as_its_solo_run():
    loop = _trainer().terminate_on_nan()
    with pytest.warns(RuntimeWarning):
        solo = loop.run(_nan_in_epoch_1(_data()), epochs=3)
    with pytest.warns(RuntimeWarning):
        pop = loop.run(_nan_in_epoch_1(_data()), epochs=3, population=2)
    member = pop.member(0)
    assert (solo.status, solo.epoch, sorted(solo.history)) == ("halted", 1, [0])
    assert (member.status, member.epoch, sorted(member.history)) == ("halted", 1, [0])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_handler_halt_stops_every_member():
    data = _data()
    loop = _trainer().handle_event(
        "epoch_completed", lambda s: "halt_loop" if s.epoch == 1 else None
    )
    pop = loop.run(data, epochs=5, population=3)
    assert pop.status == "halted" and sorted(pop.history) == [0, 1]
    assert all(pop.member(i).status == "halted" for i in range(3))


def test_handlers_see_arrays():
    seen = []
    loop = _trainer().handle_event(
        "iteration_completed", lambda s: seen.append(s.metrics["loss"]), filter={"every": 3}
    )
    loop.run(_data(), epochs=1, fuse=4, population=2)
    assert seen and all(np.shape(v) == (2,) for v in seen)


# ----------------------------------------------------------------- checkpoint and resume
def test_checkpoint_and_resume_a_population(tmp_path):
    data = _data()
    loop = _trainer()
    whole = loop.run(data, epochs=4, fuse=4, population=3)
    half = loop.run(data, epochs=2, fuse=4, population=3)
    fl.save_state(half, tmp_path / "pop")
    loaded = fl.load_state(tmp_path / "pop")
    assert loaded.population == 3
    resumed = loop.run(data, loaded, epochs=4, fuse=4)
    assert tree_equal(resumed.step_state, whole.step_state)
    for epoch in whole.history:
        assert np.array_equal(resumed.history[epoch]["loss"], whole.history[epoch]["loss"])
    # One array is the State's metric and its history's, a resumed run's too: read-only.
    for table in (half.history[1], loaded.history[0], resumed.metrics):
        with pytest.raises(ValueError, match="read-only"):
            table["loss"] *= 0
    again = loop.run(data, loaded, epochs=3, fuse=4, population=3)  # the same members: fine
    assert sorted(again.history) == [0, 1, 2]
    with pytest.raises(ValueError, match="differs from the population"):
        loop.run(data, loaded, epochs=4, population=2)


def test_resume_keeps_halted_members_frozen(tmp_path):
    data = _data()
    loop = _stopping(patience=1)
    population = {"learning_rate": [0.0, 1.0]}
    whole = loop.run(data, epochs=6, fuse=4, population=population)
    half = loop.run(data, epochs=3, fuse=4, population=population)
    fl.save_state(half, tmp_path / "p")
    resumed = loop.run(data, fl.load_state(tmp_path / "p"), epochs=6, fuse=4)
    assert tree_equal(resumed.step_state, whole.step_state)
    assert resumed.handler_metadata["_population"] == whole.handler_metadata["_population"]


def test_checkpoint_handler_saves_the_population(tmp_path):
    data = _data()
    loop = _trainer().checkpoint(str(tmp_path / "ckpt"))
    pop = loop.run(data, epochs=2, fuse=4, population=2)
    loaded = fl.load_state(tmp_path / "ckpt")
    assert loaded.population == 2
    assert tree_equal(loaded.step_state, pop.step_state)
    assert np.array_equal(loaded.history[1]["loss"], pop.history[1]["loss"])


def test_monitors_need_one_value_per_member():
    data = _data()

    def scalar(state):
        return "continue", state.replace(metrics={**state.metrics, "total": 1.0})

    loop = _trainer().handle_event("epoch_completed", scalar).early_stop("total")
    with pytest.raises(ValueError, match=r"'total' holds \(1,\) values; a population"):
        loop.run(data, population=2)
    with pytest.raises(ValueError, match="is not among this epoch's metrics"):
        _trainer().reduce_lr_on_plateau("nope").run(data, population=2)


def test_a_halted_members_iteration_metrics_read_nan_its_rate_included():
    # Member 1 stops at epoch 1 (its score never improves); in epoch 2 it steps no more,
    # so its loss and its learning rate ("last" of the step's rate) read NaN, not 0.
    scores = {0: [2.0, 2.0], 1: [1.0, 3.0], 2: [0.5, 3.0]}
    seen = []

    def score(state):
        value = np.asarray(scores[state.epoch], np.float32)
        return "continue", state.replace(metrics={**state.metrics, "score": value})

    def keep(state):
        if state.epoch == 2:
            seen.append({k: np.asarray(state.metrics[k]) for k in ("loss", "learning_rate")})

    loop = _trainer().handle_event("epoch_completed", score).early_stop("score", patience=1)
    loop = loop.handle_event("iteration_completed", keep)
    loop.run(_data(), epochs=3, population={"learning_rate": [0.1, 0.2]})
    assert seen and all(np.isnan(m["loss"][1]) and np.isnan(m["learning_rate"][1]) for m in seen)
    assert all(m["learning_rate"][0] == np.float32(0.1) for m in seen)
