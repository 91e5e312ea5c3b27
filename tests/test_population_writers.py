"""CSV and log output of a population: one value per member, fused equal to unfused."""

import csv
import io
import warnings

import numpy as np
import pytest

import fuseloop as fl

RNG = np.random.default_rng(1)
X = RNG.normal(size=(48, 4)).astype(np.float32)
Y = RNG.integers(0, 3, 48).astype(np.int32)
TRAIN = fl.data.arrays(X, Y, batch_size=8, seed=0)
MODEL = fl.models.mlp([8, 3])


def test_csv_and_log_write_one_value_per_member(tmp_path):
    outputs = {}
    for fuse in (False, 4):
        stream = io.StringIO()
        path = tmp_path / f"m{fuse}.csv"
        loop = fl.trainer(
            MODEL, "sparse_categorical_cross_entropy", "sgd", log=3, log_stream=stream
        ).csv_log(str(path))
        state = loop.run(TRAIN, epochs=2, fuse=fuse, population=3)
        outputs[fuse] = (stream.getvalue(), path.read_text())
    assert outputs[False] == outputs[4]
    rows = list(csv.DictReader(io.StringIO(outputs[False][1])))
    assert len(rows) == 2
    for i in range(3):
        assert float(rows[1][f"loss[{i}]"]) == float(state.history[1]["loss"][i])
    assert "loss: [" in outputs[False][0]


def test_tensorboard_tags_each_member_and_stops_writing_a_stopped_one(tmp_path):
    # A stopped member's NaN was written every later epoch (and tensorboardX said so each
    # time), tagged loss_0_; its solo run writes nothing after it stops.
    pytest.importorskip("tensorboardX")
    from test_writers_plot import _scalars

    loop = (
        fl.trainer(MODEL, "sparse_categorical_cross_entropy", "sgd")
        .early_stop("loss", patience=1)
        .tensorboard(tmp_path / "tb")
    )
    state = loop.run(TRAIN, epochs=4, population={"learning_rate": [0.0, 0.5]})
    assert np.isnan(state.history[3]["loss"][0])  # member 0 (not learning) stopped
    steps = {}
    for tag, step, _ in _scalars(tmp_path / "tb"):
        steps.setdefault(tag, []).append(step)
    assert steps["epoch/loss/member_0"] == [0, 1]
    assert steps["epoch/loss/member_1"] == [0, 1, 2, 3]
    # A solo run's own 1-D metric (a handler's per-class values) is no member's.
    per_class = fl.trainer(MODEL, "sparse_categorical_cross_entropy", "sgd").handle_event(
        "epoch_completed", lambda s: ("continue", s.replace(metrics={**s.metrics, "c": np.ones(2)}))
    )
    per_class.tensorboard(tmp_path / "solo").run(TRAIN)
    solo_tags = {tag for tag, _, _ in _scalars(tmp_path / "solo")}
    assert "epoch/c[0]" in solo_tags or "epoch/c_0_" in solo_tags, solo_tags


def test_a_population_whose_members_repeat_a_seed_and_vary_nothing_warns():
    loop = fl.trainer(MODEL, "sparse_categorical_cross_entropy", "sgd")
    with pytest.warns(UserWarning, match=r"member seeds \[0, 0, 1\] repeat .*identically"):
        loop.run(TRAIN, population={"seed": [0, 0, 1]})
    with warnings.catch_warnings():  # the same seed under other rates: a fair comparison
        warnings.simplefilter("error")
        loop.run(TRAIN, population={"seed": [0, 0], "learning_rate": [0.1, 0.2]})
