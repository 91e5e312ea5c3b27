"""Two real processes on localhost under `jax.distributed`, started by `fuseloop launch`.

One launch runs every multi-process check (process rows, global assembly, config agreement,
process-0 side effects, collective saves, training fused/unfused with per-process input,
validation, early stopping and a resume) and writes what each process saw; a second
launch kills one process mid-run; a third shows the configuration differences refused
before training, then a process that raises. Each launch takes a few seconds (mostly
imports).
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import fuseloop as fl
from conftest import with_compilation_cache

_COMMON = textwrap.dedent("""
    import json, os, signal, sys
    import jax
    import jax.numpy as jnp
    import numpy as np
    import fuseloop as fl
    from fuseloop import _distributed as dist
    from fuseloop.handlers.checkpoint import Checkpointer, list_checkpoints

    out = sys.argv[1] if __name__ == "__main__" else None
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    batch = jax.NamedSharding(mesh, jax.P("data"))
    replicated = jax.NamedSharding(mesh, jax.P())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    # fl.data.arrays sources, given the full arrays on every process, are right whether the
    # engine assembles each process's share or is handed whole global batches.
    train = fl.data.arrays(x[:64], y[:64], 16, shuffle=False)
    val = fl.data.arrays(x[64:], y[64:], 16, shuffle=False)
    model = fl.models.mlp([8, 3])
    trainer = (fl.trainer(model, "sparse_categorical_cross_entropy", "adam").metric("accuracy")
               .validate(model, val).early_stop("validation_loss", patience=1))


    def local_share():
        # Per-process input: each process feeds only its rows of every global batch.
        rows = dist.local_rows(batch, 16)
        for start in range(0, 64, 16):  # assembled here: the engine receives global arrays
            bx, by = x[start:start + 16], y[start:start + 16]
            yield dist.assemble_global((bx[rows], by[rows]), batch)


    # Whether the engine assembles each process's share itself (docs/distributed.md).
    import fuseloop._placement, fuseloop.data
    ENGINE_ASSEMBLES = (hasattr(fuseloop._placement, "assemble_global")
                        and hasattr(fuseloop.data, "local_indices"))


    # Device-resident data: each process stores only its devices' rows and the gather runs
    # inside the program (docs/distributed.md); 62 rows end with a short batch of 14, 61
    # rows pad to 62 (31 a process). Validation data is resident too.
    val_resident = fl.data.arrays(x[64:], y[64:], 16, shuffle=False, device=True)
    resident_trainer = (
        fl.trainer(model, "sparse_categorical_cross_entropy", "adam").metric("accuracy")
        .validate(model, val_resident).early_stop("validation_loss", patience=1, min_delta=0.05))
    RESIDENT_CASES = {"resident_short": (62, False, 2), "resident_padded": (61, True, False),
                      "resident_whole_run": (61, True, "run")}


    def resident_source(n, drop_remainder):
        return fl.data.arrays(x[:n], y[:n], 16, shuffle=True, seed=5,
                              drop_remainder=drop_remainder, device=True)


    def params(state):
        # (An nnx model's params hold its RNG streams' keys: their key data.)
        return [np.asarray(jax.random.key_data(leaf) if jnp.issubdtype(
                    leaf.dtype, jax.dtypes.prng_key) else leaf).tolist()
                for leaf in jax.tree.leaves(state.params)]


    def nnx_dropout_run(mesh=None):
        # An nnx model keeps typed PRNG keys (its dropout stream) in the step state.
        from flax import nnx

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.a, self.b = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)
                self.drop = nnx.Dropout(0.3, rngs=rngs)

            def __call__(self, x):
                return self.b(self.drop(nnx.relu(self.a(x))))

        net = Net(nnx.Rngs(0))
        loop = fl.trainer(net, "sparse_categorical_cross_entropy", "adam")
        return loop.run(train, epochs=2, fuse=2, mesh=mesh)
""")

_UNITS = textwrap.dedent("""
    result = {"count": dist.process_count(), "index": dist.process_index()}
    full = np.arange(24, dtype=np.float32).reshape(8, 3)
    rows = dist.local_rows(batch, 8)
    chunk = jax.NamedSharding(mesh, jax.P(None, "data"))
    result["rows"] = [rows.start, rows.stop, dist.process_block(8).start]
    result["indices"] = dist.local_indices(np.arange(8) * 10, 8, batch).tolist()
    g = dist.assemble_global({"x": full[rows]}, batch)["x"]
    result["row_sums"] = np.asarray(
        jax.jit(lambda a: a.sum(axis=1), out_shardings=replicated)(g)).tolist()
    stacked = np.stack([full, 2 * full, 3 * full])  # a chunk of three global batches
    c = dist.assemble_global(stacked[:, dist.local_rows(chunk, 8, batch_axis=1)], chunk)
    result["chunk_total"] = float(jax.jit(lambda a: a.sum(), out_shardings=replicated)(c))
    dist.check_same_config({"batch_size": 16, "epochs": 3, "model": model})
    try:
        dist.check_same_config({"batch_size": 16 * (1 + dist.process_index()), "epochs": 3})
    except ValueError as err:
        result["config_error"] = str(err)
    try:  # a different model on process 1: its variables differ in shape
        variables = fl.models.mlp([8 + dist.process_index(), 3]).init(
            jax.random.key(0), np.zeros((1, 4), np.float32))
        dist.check_same_config({"model": dist.describe(variables, values=True)})
    except ValueError as err:
        result["model_error"] = str(err)
    calls = []
    dist.main_process_only(lambda s: calls.append("main"))(None)
    dist.main_process_only(dist.all_processes(lambda s: calls.append("all")))(None)
    result["calls"] = calls
    # Collective saves of a replicated and a process-sharded array.
    state = fl.State(epoch=1, history={1: {"loss": 0.25}},
                     step_state={"w": jax.device_put(jnp.arange(4.0), replicated), "x": g})
    fl.save_state(state, os.path.join(out, "one"))
    fl.save_state(state.replace(epoch=2), os.path.join(out, "one"))  # replaced collectively
    loaded = fl.load_state(os.path.join(out, "one"))
    result["loaded"] = [loaded.epoch, np.asarray(loaded.step_state["x"]).tolist(),
                        loaded.history[1]["loss"]]
    saver = Checkpointer(os.path.join(out, "ck"), keep=2)
    for epoch in range(3):
        saver.save(state.replace(epoch=epoch))
    dist.sync("saved")
    result["checkpoints"] = [p.name for p in list_checkpoints(os.path.join(out, "ck"))]

    # Training: the engine on global batches every process feeds whole (fused), and on
    # global batches assembled from each process's share (unfused), then a resume.
    resident = fl.data.arrays(x[:64], y[:64], 16, shuffle=False, device=True)
    for name, data, fuse in [("fused", train, 2), ("local_share", local_share, False),
                             ("resident", resident, 2)]:
        path = os.path.join(out, f"ck_{name}")
        trained = trainer.checkpoint(path).run(data, epochs=3, fuse=fuse, mesh=mesh)
        first = fl.load_state(list_checkpoints(path)[0])
        resumed = trainer.run(data, first, epochs=3, fuse=fuse, mesh=mesh)
        result[name] = {"params": params(trained), "resumed": params(resumed),
                        "history": {str(k): v for k, v in trained.history.items()},
                        "status": trained.status, "epoch": trained.epoch}
        if name == "fused":  # an observer runs on process 0; predict reads the params here
            observed = []
            watched = trainer.observe("completed", lambda s: observed.append("main")).observe(
                "completed", dist.all_processes(lambda s: observed.append("all")))
            watched.run(data, resumed, epochs=4, fuse=fuse, mesh=mesh)
            result["observed"] = observed
            result["predicted"] = np.asarray(fl.predict(model, trained, x[:5])).tolist()
    for name, (n, drop_remainder, fuse) in RESIDENT_CASES.items():
        data = resident_source(n, drop_remainder)
        trained = resident_trainer.run(data, epochs=3, fuse=fuse, mesh=mesh)
        held = {}
        for what, source in [("train", data), ("validation", val_resident)]:
            leaf = jax.tree.leaves(source.put(batch))[0]  # placed by the run: no new move
            held[what] = {"shape": list(leaf.shape), "sharded": leaf.sharding == batch,
                          "transfers": source.transfers_done,
                          "rows": sorted([s.index[0].start, s.index[0].stop]
                                         for s in leaf.addressable_shards)}
        result[name] = {"params": params(trained), "status": trained.status,
                        "history": {str(k): v for k, v in trained.history.items()},
                        "held": held}
    nnx_state = nnx_dropout_run(mesh)
    result["nnx"] = {"params": params(nnx_state), "history": {
        str(k): v for k, v in nnx_state.history.items()}}
    auto = trainer.run(train, epochs=3, fuse="auto", mesh=mesh)  # the processes agree on K
    result["auto"] = {"params": params(auto), "chunk_size": auto.stats["chunk_size"]}
    try:  # 63 rows: a short last batch of 15, which two devices cannot split
        trainer.run(resident_source(63, False), epochs=1, mesh=mesh)
    except ValueError as error:
        result["odd_short_batch"] = str(error)
    if ENGINE_ASSEMBLES:  # no mesh given: the processes still form one global mesh
        result["auto_mesh"] = params(trainer.run(train, epochs=3, fuse=2))
    with open(os.path.join(out, f"result_{dist.process_index()}.json"), "w") as handle:
        json.dump(result, handle)
""")

_DIES = textwrap.dedent("""
    def die(state):
        if state.epoch == 1 and dist.process_index() == 1:
            print("process 1 dies now", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    loop = trainer.checkpoint(os.path.join(out, "ck")).handle_event("epoch_completed", die)
    state = loop.run(train, epochs=50, fuse=2, mesh=mesh)
    print("finished", state.status, flush=True)
""")


_RAISES = textwrap.dedent("""
    def fail(state):
        if state.epoch == 1 and dist.process_index() == 1:
            raise RuntimeError("process 1 raises now")

    state = trainer.handle_event("epoch_completed", fail).run(train, epochs=50, fuse=2, mesh=mesh)
    print("finished", state.status, flush=True)
""")


_DIFFERS = textwrap.dedent("""
    import optax
    mine = dist.process_index() == 1
    data = fl.data.arrays(x[:64], y[:64], 16, seed=1 if mine else 0)
    fixed_rate = fl.trainer(model, "sparse_categorical_cross_entropy",
                            optax.adam(1e-3 if mine else 1e-2))
    try:
        fixed_rate.run(data, epochs=2, fuse=2)
    except ValueError as error:
        print("refused:", error, flush=True)
    # What neither shows either: the metrics, a handler's settings, the dataset's values,
    # a mesh of one process's devices. Each is refused before anything trains or hangs.
    same = fl.data.arrays(x[:64], y[:64], 16)
    plain = fl.trainer(model, "sparse_categorical_cross_entropy", "adam")
    cases = {
        "metrics": (plain.metric("accuracy") if mine else plain, same, {}),
        "patience": (plain.early_stop("loss", patience=1 if mine else 5), same, {}),
        "values": (plain, fl.data.arrays(x[:64] + float(mine), y[:64], 16), {}),
        "mesh": (plain, same, {"mesh": jax.sharding.Mesh(jax.local_devices(), ("data",))}),
    }
    for name, (loop, data, options) in cases.items():
        try:
            loop.run(data, epochs=1, **options)
        except ValueError as error:
            print(f"refused {name}:", error, flush=True)
""")


def _launch(tmp_path, body: str, *options: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(_COMMON + body)
    env = with_compilation_cache({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fuseloop.cli",
            "launch",
            "-n",
            "2",
            *options,
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("two")
    # A longer heartbeat timeout than users' 10 s: a CI machine that stalls for seconds
    # (both processes were once ended as "stopped sending heartbeats") must not fail these
    # tests, which check what the processes compute, not how a death is detected.
    result = _launch(tmp_path, _UNITS, "--failure-timeout", "60")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    seen = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    return tmp_path, seen


def test_launched_processes_are_initialised_and_feed_their_rows(two_processes):
    _, seen = two_processes
    assert [(s["count"], s["index"]) for s in seen] == [(2, 0), (2, 1)]
    assert [s["rows"] for s in seen] == [[0, 4, 0], [4, 8, 4]]
    assert [s["indices"] for s in seen] == [[0, 10, 20, 30], [40, 50, 60, 70]]
    full = np.arange(24, dtype=np.float32).reshape(8, 3)
    for s in seen:  # every process computes on the whole global batch
        assert s["row_sums"] == full.sum(axis=1).tolist()
        assert s["chunk_total"] == float(full.sum() * 6)


def test_a_configuration_difference_is_named_on_every_process(two_processes):
    _, seen = two_processes
    for s in seen:
        assert "batch_size (process 0: 16, process 1: 32)" in s["config_error"]
        assert "epochs" not in s["config_error"]
        assert s["model_error"].startswith(
            "the processes of this run were given different configurations: model (process 0: "
        )


def test_side_effects_run_on_process_0_unless_marked(two_processes):
    _, seen = two_processes
    assert [s["calls"] for s in seen] == [["main", "all"], ["all"]]
    assert [s["observed"] for s in seen] == [["main", "all"], ["all"]]  # Loop.observe


def test_observers_run_on_process_0_and_the_librarys_start_observers_everywhere(monkeypatch):
    """Each process holds its own early stop and checkpoint, started by an observer of
    `started`: as observers run on process 0, those are marked to run everywhere."""
    from fuseloop import _distributed as dist
    from fuseloop.engine.bus import EventBus

    def record(state: fl.State) -> None: ...

    loop = (
        fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "adam")
        .early_stop("loss", patience=1, restore_best=True)
        .checkpoint("unused")
        .observe("started", record, name="user")
        .observe("started", dist.all_processes(lambda s: None), name="user:all")
        .log(lambda s: "", event="started")
    )
    labels = {r.label for r in loop.registrations if r.event.value == "started"}
    assert EventBus(loop.registrations).by_event[fl.Event.STARTED]  # process 0: all of them
    assert {r.label for r in EventBus(loop.registrations).by_event[fl.Event.STARTED]} == labels
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # as process 1 sees it
    on_one = {r.label for r in EventBus(loop.registrations).by_event[fl.Event.STARTED]}
    assert on_one == labels - {"user", "log"}, on_one
    assert {"early_stop:begin", "checkpoint:start", "user:all"} <= on_one


def test_a_host_fed_short_last_batch_is_refused_before_its_epochs_first_batch(monkeypatch):
    """Under several processes: at the epoch's first batch, not after training the rest."""
    x, y = np.zeros((250, 4), np.float32), np.zeros(250, np.int32)
    source = fl.data.arrays(x, y, batch_size=32, drop_remainder=False, shuffle=False)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"short last batch \(26 examples.*device=True"):
        next(iter(source.iter_epoch(0)))
    even = fl.data.arrays(x[:240], y[:240], batch_size=24, drop_remainder=False)
    assert len(list(even.iter_epoch(0))) == 10  # no short batch: nothing refused
    dropped = fl.data.arrays(x, y, batch_size=32)  # the default drops the short batch
    assert len(list(dropped.iter_epoch(0))) == 7


def test_validation_data_the_processes_cannot_feed_is_refused_before_training(monkeypatch):
    """Under several processes it was refused at the first epoch's end, after training it:
    the validation's start checks (at `started`) refuse it as its epoch would."""
    from fuseloop.handlers.validate import Validator

    x, y = np.zeros((30, 4), np.float32), np.zeros(30, np.int32)
    model = fl.models.mlp([3])
    evaluator = fl.evaluator(model, "sparse_categorical_cross_entropy")
    variables = model.init(jax.random.key(0), x[:1])
    start = fl.State(step_state={"params": variables})
    short = fl.data.arrays(x, y, batch_size=16, drop_remainder=False, shuffle=False)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"short last batch \(14 examples") as caught:
        Validator(evaluator, short).begin(start)
    assert "validate()'s data" in str(caught.value.__notes__)
    for whole in (fl.data.arrays(x, y, 15), fl.data.arrays(x, y, 16, drop_remainder=True)):
        Validator(evaluator, whole).begin(start)  # no short batch: nothing refused
    # On the device, the processes validate over their global mesh (4 devices here): a
    # batch must divide over it, the short one too.
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    resident = fl.data.arrays(x, y, batch_size=16, drop_remainder=False, device=True)
    with pytest.raises(ValueError, match=r"short last batch .* holds 14 examples") as caught:
        Validator(evaluator, resident).begin(start)
    assert "validate()'s data" in str(caught.value.__notes__)
    with pytest.raises(ValueError, match=r"batch size 15 does not divide over the 4 devices"):
        Validator(evaluator, fl.data.arrays(x, y, 15, device=True)).begin(start)
    x, y = np.zeros((28, 4), np.float32), np.zeros(28, np.int32)  # a short batch of 12
    Validator(evaluator, fl.data.arrays(x, y, 16, drop_remainder=False, device=True)).begin(start)


def test_predict_after_a_run_over_two_processes_reads_the_replicated_params(two_processes):
    _, seen = two_processes  # it raised JAX's "fully addressable" device_put error
    assert np.shape(seen[0]["predicted"]) == (5, 3)
    assert seen[0]["predicted"] == seen[1]["predicted"]


def test_saves_are_collective(two_processes):
    tmp_path, seen = two_processes
    x = np.arange(24, dtype=np.float32).reshape(8, 3).tolist()
    for s in seen:
        assert s["loaded"] == [2, x, 0.25]
        assert s["checkpoints"] == ["checkpoint_000002_epoch_1", "checkpoint_000003_epoch_2"]
    assert fl.load_state(tmp_path / "one").epoch == 2  # and loads in a single process


def _common(tmp_path) -> dict:
    """The launched scripts' set-up (data, trainer), run in this single process."""
    script = tmp_path / "common.py"
    script.write_text(_COMMON)
    return runpy.run_path(str(script))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training in this single process, on one device."""
    common = _common(tmp_path_factory.mktemp("reference"))
    return common["trainer"].run(common["train"], epochs=3, fuse=2)


@pytest.fixture(scope="module")
def resident_reference(tmp_path_factory):
    """The device-resident runs in this single process, on one device."""
    common = _common(tmp_path_factory.mktemp("resident"))
    out = {}
    for name, (n, drop_remainder, fuse) in common["RESIDENT_CASES"].items():
        data = common["resident_source"](n, drop_remainder)
        out[name] = common["resident_trainer"].run(data, epochs=3, fuse=fuse)
    return out


@pytest.mark.parametrize("name", ["resident_short", "resident_padded", "resident_whole_run"])
def test_each_process_holds_only_its_rows_of_resident_data(two_processes, name):
    _, seen = two_processes
    train_rows = {"resident_short": 62, "resident_padded": 62, "resident_whole_run": 62}[name]
    for index, s in enumerate(seen):
        held = s[name]["held"]
        assert held["train"]["sharded"] and held["validation"]["sharded"]
        assert held["train"]["shape"] == [train_rows, 4]  # 61 rows are padded to 62
        half = train_rows // 2
        assert held["train"]["rows"] == [[index * half, (index + 1) * half]]
        assert held["validation"]["rows"] == [[index * 16, (index + 1) * 16]]
        assert held["train"]["transfers"] == 1


def _assert_within_rounding(seen: dict, reference) -> None:
    """A process's params and history against a 1-device run of the same global batches:
    one device sums the batch's gradients in another order than two, so within rounding."""
    for mine, theirs in zip(seen["params"], jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-5, atol=1e-6)
    for epoch, metrics in reference.history.items():
        for key, value in metrics.items():
            assert seen["history"][str(epoch)][key] == pytest.approx(value, rel=1e-5)


@pytest.mark.parametrize("name", ["resident_short", "resident_padded", "resident_whole_run"])
def test_two_processes_on_resident_data_train_like_one(two_processes, resident_reference, name):
    _, seen = two_processes
    first, second = (s[name] for s in seen)
    reference = resident_reference[name]
    assert first["params"] == second["params"] and first["history"] == second["history"]
    assert first["status"] == second["status"] == reference.status
    assert sorted(int(e) for e in first["history"]) == sorted(reference.history)
    _assert_within_rounding(first, reference)


@pytest.mark.parametrize("name", ["fused", "local_share", "resident"])
def test_two_processes_train_like_one(two_processes, reference, name):
    _, seen = two_processes
    first, second = (s[name] for s in seen)
    # Every process holds the same params and saw the same metrics and halting.
    assert first["params"] == second["params"] and first["history"] == second["history"]
    assert (first["status"], first["epoch"]) == (second["status"], second["epoch"])
    assert first["resumed"] == first["params"]  # load_state + resume, bitwise
    assert sorted(int(e) for e in first["history"]) == sorted(reference.history)
    _assert_within_rounding(first, reference)


def test_fused_per_process_input_and_device_resident_agree_bitwise(two_processes):
    _, seen = two_processes
    assert seen[0]["fused"]["params"] == seen[0]["local_share"]["params"]
    assert seen[0]["fused"]["params"] == seen[0]["resident"]["params"]
    assert seen[1]["resident"]["resumed"] == seen[1]["resident"]["params"]


def test_a_dead_process_fails_the_run_in_bounded_time_and_the_checkpoint_loads(tmp_path):
    began = time.monotonic()
    result = _launch(tmp_path, _DIES, "--grace", "1")
    elapsed = time.monotonic() - began
    assert result.returncode != 0 and elapsed < 120
    assert "[1] process 1 dies now" in result.stdout
    assert "[launch] process 1 was killed by SIGKILL; stopping the other processes" in result.stdout
    # The launcher's SIGTERM halts process 0 gracefully if it lands between epochs: that run
    # may return "halted", but no process may complete its 50 epochs.
    assert "finished completed" not in result.stdout
    latest = fl.load_state(tmp_path / "ck")
    assert latest.epoch == 1 and latest.status == "running"  # the last complete save
    common = _common(tmp_path)
    resumed = common["trainer"].run(common["train"], latest, epochs=latest.epoch + 2, fuse=2)
    assert sorted(resumed.history) == list(range(latest.epoch + 2))


@pytest.fixture(scope="module")
def refusals_then_a_raise(tmp_path_factory) -> subprocess.CompletedProcess:
    """One launch: the configuration refusals, then a run whose process 1 raises."""
    return _launch(tmp_path_factory.mktemp("refusals"), _DIFFERS + _RAISES, "--grace", "1")


def test_a_process_that_raises_fails_the_launch_with_its_own_code_and_name(refusals_then_a_raise):
    # Not jax's shutdown barrier, then a SIGABRT of whichever process aborted first.
    result = refusals_then_a_raise
    assert result.returncode == 1, result.stdout[-3000:]
    assert "RuntimeError: process 1 raises now" in result.stdout
    assert "[launch] process 1 exited with code 1; stopping the other processes" in result.stdout
    assert "finished completed" not in result.stdout  # a graceful halt of process 0 may finish


def test_a_different_data_order_or_fixed_learning_rate_is_named_before_training(
    refusals_then_a_raise,
):
    # Neither shows in the step state's shapes or values: the data source's description
    # and the traced step's digest are compared too. The launch then fails by design (its
    # second part raises); that part's own test shows the refusals left both processes
    # running (process 1 reaches its raise, and is the process the launcher names).
    result = refusals_then_a_raise
    for index in range(2):
        (line,) = [s for s in result.stdout.splitlines() if s.startswith(f"[{index}] refused:")]
        assert "data (process 0:" in line and "seed=0" in line and "seed=1" in line
        assert "training step (e.g. the optimizer's constants" in line
        refused = {
            s.split(":")[0].split()[-1]: s
            for s in result.stdout.splitlines()
            if s.startswith(f"[{index}] refused ")
        }
        assert "configurations: metrics (process 0" in refused["metrics"]
        assert "configurations: handlers (their settings)" in refused["patience"]
        assert "'patience': 1}" in refused["patience"] and "'patience': 5}" in refused["patience"]
        assert "configurations: data values (process 0" in refused["values"]
        assert "mesh: under jax.distributed it must span every process" in refused["mesh"]


def test_an_nnx_model_with_a_dropout_stream_trains_in_two_processes_as_in_one(
    two_processes, tmp_path
):
    """Its typed PRNG keys met numpy in the configuration check, then device_put."""
    _, seen = two_processes
    first, second = (s["nnx"] for s in seen)
    assert first == second
    common = _common(tmp_path)
    reference = common["nnx_dropout_run"]()
    for mine, theirs in zip(first["params"], common["params"](reference), strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-5, atol=1e-6)
    assert list(first["history"]) == ["0", "1"]


def test_fuse_auto_picks_one_chunk_size_for_every_process(two_processes):
    """It timed a probe chunk on each process (and crashed placing it): now nothing is
    timed, each takes fuse=True's chunk balanced over the epoch of 4 batches."""
    _, seen = two_processes
    assert [s["auto"]["chunk_size"] for s in seen] == [4, 4]
    assert seen[0]["auto"]["params"] == seen[1]["auto"]["params"] == seen[0]["fused"]["params"]


def test_a_short_batch_the_devices_cannot_split_is_not_told_to_drop_a_mesh_it_needs(
    two_processes,
):
    _, seen = two_processes
    for s in seen:
        message = s["odd_short_batch"]
        assert "holds 15 examples" in message and "drop_remainder=True" in message, message
        assert "mesh=None" not in message  # several processes always share one mesh


def test_without_a_mesh_the_processes_form_one(two_processes):
    _, seen = two_processes
    if "auto_mesh" not in seen[0]:
        pytest.skip("the engine does not assemble per-process shares yet")
    assert seen[0]["auto_mesh"] == seen[1]["auto_mesh"] == seen[0]["fused"]["params"]
