"""Device-resident data over a mesh is stored sharded along its example axis.

`fl.data.arrays(..., device=True)` run with `mesh=` keeps each device's block of rows only
(padded with zero rows to a multiple of the shard count), and the chunk's gather runs on
the sharded array inside the compiled program. The results are bitwise those of the same
run with the dataset replicated (how it was stored before) and of the host-fed run on the
same mesh. The checks run in one subprocess with 4 virtual CPU devices (the device count
is fixed when jax starts); it prints one JSON line of findings.
"""

from __future__ import annotations

import textwrap

import pytest

from conftest import run_on_four_devices

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import fuseloop as fl
    import fuseloop._placement as placement

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(82, 3)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int32)
    model = fl.models.mlp([8, 2])
    val = fl.data.arrays(x[62:], y[62:], 4, shuffle=False, device=True)
    loop = (fl.trainer(model, "sparse_categorical_cross_entropy", "adam").metric("accuracy")
            .validate(model, val).early_stop("validation_loss", patience=1, min_delta=0.03))
    out = {}

    def storage(source):
        leaves = jax.tree.leaves(source.put(NamedSharding(mesh, P("data"))))
        return {
            "batch_sharded": [leaf.sharding == NamedSharding(mesh, P("data")) for leaf in leaves],
            "shapes": [list(leaf.shape) for leaf in leaves],
            "rows": [sorted([s.index[0].start, s.index[0].stop, s.data.shape[0]]
                            for s in leaf.addressable_shards) for leaf in leaves],
            "padding": [float(np.abs(np.asarray(leaf)[source.n:]).sum()) for leaf in leaves],
            "transfers": source.transfers_done,
        }

    def summary(state):
        return {
            "params": [np.asarray(a).tolist() for a in jax.tree.leaves(state.params)],
            "history": {str(e): m for e, m in state.history.items()},
            "status": state.status,
            "whole_run": str(state.stats.get("whole_run")),
            "h2d": state.stats["h2d_transfers"],
            "compiles": state.stats["compiles"],
        }

    # 62 rows pad to 64 (16 a device); 60 rows with a short last batch of 4.
    cases = {"padded": dict(n=62, drop_remainder=True), "short": dict(n=60, drop_remainder=False)}
    for case, c in cases.items():
        def source(device):
            n = c["n"]
            return fl.data.arrays(x[:n], y[:n], 8, shuffle=True, seed=3,
                                  drop_remainder=c["drop_remainder"], device=device)
        fuses = [4, False] + (["run"] if c["drop_remainder"] else [])
        for fuse in fuses:
            data = source(True)
            out[f"{case}-resident-{fuse}"] = summary(loop.run(data, epochs=5, fuse=fuse, mesh=mesh))
            out[f"{case}-storage-{fuse}"] = storage(data)
            again = loop.run(data, epochs=5, fuse=fuse, mesh=mesh)
            out[f"{case}-again-{fuse}"] = summary(again)
        host_fuse = 4 if c["drop_remainder"] else False  # a host-fed short batch: unfused
        out[f"{case}-host"] = summary(loop.run(source(False), epochs=5, fuse=host_fuse, mesh=mesh))
        if case != "padded":
            continue
        # The dataset as it was stored before: replicated on every device.
        sharded = placement.Placement.dataset
        placement.Placement.dataset = property(lambda self: self.replicated)
        try:
            replicated = source(True)
            out[f"{case}-replicated"] = summary(loop.run(replicated, epochs=5, fuse=4, mesh=mesh))
            out[f"{case}-replicated-storage"] = [
                leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(replicated.put(
                    NamedSharding(mesh, P())))] + [replicated.transfers_done]
        finally:
            placement.Placement.dataset = sharded
    # Gathering from rows split over devices sums zeros from the devices that do not hold
    # a row; the gather keeps every bit anyway (-0.0 stays -0.0).
    signed = np.where(np.arange(64)[:, None] % 3 == 0, -0.0, 1.0).astype(np.float32) * np.ones(3)
    counter = fl.loop(lambda batch, state: {"neg": state["neg"] + jnp.signbit(batch[0]).sum()})
    for fuse in (4, False):
        signs = fl.data.arrays(signed, y[:64], 8, seed=2, device=True)
        counted = counter.run(signs, {"neg": np.int32(0)}, fuse=fuse, mesh=mesh)
        out[f"signs-{fuse}"] = [int(counted.step_state["neg"]), int(np.signbit(signed).sum())]
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def findings() -> dict:
    return run_on_four_devices(SCRIPT)


@pytest.mark.parametrize("fuse", [4, False, "run"])
def test_the_padded_dataset_is_split_over_the_devices(findings, fuse):
    storage = findings[f"padded-storage-{fuse}"]
    assert storage["batch_sharded"] == [True, True]  # NamedSharding(mesh, P("data"))
    assert storage["shapes"] == [[64, 3], [64]]  # 62 examples, padded to 4 x 16
    expected = [[0, 16, 16], [16, 32, 16], [32, 48, 16], [48, 64, 16]]  # start, stop, rows
    assert storage["rows"] == [expected, expected]  # each device: its 16 rows only
    assert storage["padding"] == [0.0, 0.0]
    assert storage["transfers"] == 1  # placed once, by the run, with this sharding


@pytest.mark.parametrize("fuse", [4, False])
def test_a_dataset_that_divides_is_not_padded(findings, fuse):
    storage = findings[f"short-storage-{fuse}"]
    assert storage["shapes"] == [[60, 3], [60]]
    assert [len(rows) for rows in storage["rows"]] == [4, 4]
    assert all(row[2] == 15 for rows in storage["rows"] for row in rows)


@pytest.mark.parametrize("case", ["padded", "short"])
def test_sharded_storage_is_bitwise_the_replicated_and_the_host_fed_run(findings, case):
    sharded = findings[f"{case}-resident-4"]
    others = ["host", "resident-False"]
    if case == "padded":
        assert findings["padded-replicated-storage"] == [True, True, 1]
        others.append("replicated")
    for other in others:
        theirs = findings[f"{case}-{other}"]
        assert sharded["params"] == theirs["params"], other
        assert sharded["history"] == theirs["history"], other
    assert sharded["status"] == "halted" and len(sharded["history"]) < 5  # early stopping


def test_whole_run_fusion_on_the_sharded_dataset_is_bitwise(findings):
    whole, chunked = findings["padded-resident-run"], findings["padded-resident-4"]
    assert whole["params"] == chunked["params"] and whole["history"] == chunked["history"]


@pytest.mark.parametrize("key", ["padded-again-4", "padded-again-run", "short-again-False"])
def test_a_second_run_reuses_the_placed_dataset_and_its_programs(findings, key):
    again = findings[key]
    assert again["compiles"] == 0 and again["h2d"] == 0


@pytest.mark.parametrize("fuse", [4, False])
def test_the_gather_keeps_the_sign_of_zero(findings, fuse):
    counted, expected = findings[f"signs-{fuse}"]
    assert counted == expected > 0
