"""CSV and log output of a population: one value per member, fused equal to unfused."""

import csv
import io

import numpy as np

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
