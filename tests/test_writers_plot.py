"""CSV and TensorBoard writers (identical fused and unfused) and plot_history."""

from __future__ import annotations

import csv
import io
import struct
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_tree_equal

MODEL = fl.models.mlp([8, 3])


def _batches(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, size=(8,)).astype(np.int32))
        for _ in range(n)
    ]


DATA, VAL = _batches(5, 0), _batches(3, 1)
TRAINER = (
    fl.trainer(MODEL, "sparse_categorical_cross_entropy", "adam")
    .metric("accuracy")
    .validate(MODEL, VAL)
)


def _with_writers(loop: fl.Loop, folder) -> fl.Loop:
    return (
        loop.csv_log(folder / "epochs.csv")
        .csv_log(folder / "iterations.csv", event="iteration_completed", filter={"every": 2})
        .tensorboard(folder / "tb")
        .tensorboard(folder / "tb", event="iteration_completed", filter={"every": 3})
    )


def _scalars(logdir) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar event under `logdir`, wall times left out."""
    from tensorboardX.proto import event_pb2

    found = []
    for path in sorted(logdir.iterdir()):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):  # TFRecord: length, crc, payload, crc
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                found.append((value.tag, event.step, value.simple_value))
    return found


def _shown_steps(logdir, tag: str) -> list[int]:
    """The steps of `tag` TensorBoard shows: each file, in the order written, hides the
    earlier files' points from its purge step (a SessionLog START) on."""
    from tensorboardX.proto import event_pb2

    shown: list[int] = []
    for path in sorted(logdir.iterdir(), key=lambda p: p.stat().st_mtime_ns):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                shown = [step for step in shown if step < event.step]
            shown += [event.step for value in event.summary.value if value.tag == tag]
    return sorted(shown)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    runs = {}
    for fuse in (False, 3):
        folder = tmp_path_factory.mktemp(f"fuse{fuse}")
        runs[fuse] = (folder, _with_writers(TRAINER, folder).run(DATA, epochs=3, fuse=fuse))
    return runs


def test_csv_files_are_identical_fused_and_unfused(written):
    (unfused, _), (fused, _) = written[False], written[3]
    for name in ("epochs.csv", "iterations.csv"):
        assert (fused / name).read_bytes() == (unfused / name).read_bytes()


def test_csv_rows_hold_the_metrics(written):
    folder, state = written[False]
    with open(folder / "epochs.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    for row in rows:
        for name, value in state.history[int(row["epoch"])].items():
            assert float(row[name]) == value  # exact: written with repr
    with open(folder / "iterations.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    # every=2 on the running count of iterations (5 an epoch): counts 1, 3, 5, ...
    assert [int(r["step"]) for r in rows] == list(range(1, 16, 2))
    assert [(int(r["epoch"]), int(r["iteration"])) for r in rows][:3] == [(0, 0), (0, 2), (0, 4)]
    assert "validation_loss" not in rows[0]


def test_tensorboard_scalars_are_identical_fused_and_unfused(written):
    (unfused, state), (fused, _) = written[False], written[3]
    expected = _scalars(unfused / "tb")
    assert expected == _scalars(fused / "tb")
    epoch_scalars = {
        (tag, step): value for tag, step, value in expected if tag.startswith("epoch/")
    }
    for epoch, metrics in state.history.items():
        for name, value in metrics.items():
            assert epoch_scalars[("epoch/" + name, epoch)] == np.float32(value)
    iteration_steps = sorted({step for tag, step, _ in expected if tag == "iteration/loss"})
    assert iteration_steps == list(range(1, 16, 3))


def _counter_loop() -> fl.Loop:
    def step(batch, s):
        return {"n": s["n"] + 1, "loss": 1.0 / (s["n"] + 1.0)}

    return fl.loop(step).metric("loss")


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_run_that_raises_closes_its_writers_with_what_they_wrote(tmp_path, fuse):
    def fail_in_epoch_2(state):
        if state.epoch == 2:
            raise RuntimeError("boom")

    loop = _counter_loop().tensorboard(tmp_path / "tb").csv_log(tmp_path / "m.csv")
    loop = loop.handle_event("epoch_completed", fail_in_epoch_2)
    with pytest.raises(RuntimeError, match="boom"):
        start = {"n": jnp.float32(0.0), "loss": jnp.float32(0.0)}
        loop.run([(0, 0)] * 4, start, epochs=5, fuse=fuse)
    # Closed, so flushed: epochs 0-2 (the writers run before the handler that raises).
    assert [(tag, step) for tag, step, _ in _scalars(tmp_path / "tb")] == [
        ("epoch/loss", 0),
        ("epoch/loss", 1),
        ("epoch/loss", 2),
    ]
    with open(tmp_path / "m.csv") as rows:
        assert [row["epoch"] for row in csv.DictReader(rows)] == ["0", "1", "2"]


def test_csv_of_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    start = {"n": jnp.float32(0.0), "loss": jnp.float32(0.0)}
    loop = _counter_loop().csv_log(tmp_path / "full.csv")
    loop.run([(0, 0)] * 2, start, epochs=4)
    resuming = _counter_loop().csv_log(tmp_path / "resumed.csv")
    first = resuming.run([(0, 0)] * 2, start, epochs=3)
    # Resume from epoch 1, as from a checkpoint: the row of epoch 2 is redone, not doubled.
    from_epoch_1 = first.replace(
        history={e: first.history[e] for e in (0, 1)},
        step_state={"n": jnp.float32(4.0), "loss": jnp.float32(0.0)},
    )
    resuming.run([(0, 0)] * 2, from_epoch_1, epochs=4)
    assert (tmp_path / "resumed.csv").read_text() == (tmp_path / "full.csv").read_text()


def test_a_resumed_csv_that_another_run_wrote_since_is_warned_of(tmp_path):
    path = tmp_path / "m.csv"
    loop = TRAINER.csv_log(path)
    first = loop.run(DATA, epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resuming its own file: no word
        loop.run(DATA, first, epochs=3)
    loop.run(_batches(5, 7), epochs=2)  # another run over the same file
    with pytest.warns(UserWarning, match=r"row for epoch 0 that is not the resumed State's"):
        loop.run(DATA, first, epochs=3)


def test_tensorboard_of_a_resumed_run_shows_what_the_uninterrupted_one_does(tmp_path):
    """The redone epoch's points (and its iterations') are hidden, not drawn twice."""
    start = {"n": jnp.float32(0.0), "loss": jnp.float32(0.0)}

    def written(loop: fl.Loop, name: str) -> fl.Loop:
        loop = loop.tensorboard(tmp_path / name / "epochs")
        return loop.tensorboard(tmp_path / name / "its", event="iteration_completed")

    written(_counter_loop(), "full").run([(0, 0)] * 2, start, epochs=4)
    resuming = written(_counter_loop(), "resumed")
    saved = resuming.run([(0, 0)] * 2, start, epochs=2)  # as a checkpoint after epoch 1
    resuming.run([(0, 0)] * 2, saved, epochs=3)
    resuming.run([(0, 0)] * 2, saved, epochs=4)  # epoch 2 again, from the checkpoint
    for sub, tag in (("epochs", "epoch/loss"), ("its", "iteration/loss")):
        full = _shown_steps(tmp_path / "full" / sub, tag)
        assert _shown_steps(tmp_path / "resumed" / sub, tag) == full, sub
    assert _shown_steps(tmp_path / "full" / "epochs", "epoch/loss") == [0, 1, 2, 3]


def test_writer_paths_that_cannot_be_made_are_refused_when_attached(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    loop = _counter_loop()
    with pytest.raises(ValueError, match=r"is a directory; give a file path"):
        loop.csv_log(tmp_path)
    with pytest.raises(ValueError, match=r"'.*a_file' is a file, so no file can be made"):
        loop.csv_log(blocker / "m.csv")
    with pytest.raises(ValueError, match=r"'.*a_file' is a file, so no directory can be made"):
        loop.tensorboard(blocker)
    loop.csv_log(blocker)  # an existing file is a file path: a fresh run rewrites it


def test_csv_adds_a_column_when_a_metric_appears(tmp_path):
    def late(state):
        if state.epoch == 1:
            return "continue", state.replace(metrics={**state.metrics, "extra": 2.5})
        return None

    start = {"n": jnp.float32(0.0), "loss": jnp.float32(0.0)}
    loop = _counter_loop().handle_event("epoch_completed", late).csv_log(tmp_path / "m.csv")
    loop.run([(0, 0)], start, epochs=3)
    with open(tmp_path / "m.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["extra"] for r in rows] == ["", "2.5", ""]


def test_a_metric_named_as_a_csv_column_is_refused_not_written_over_it(tmp_path):
    # Its value overwrote the epoch column, and a resume then failed reading the file.
    with pytest.raises(ValueError, match=r"a metric is named 'epoch'.* name='epoch_value'"):
        _counter_loop().metric(lambda y, p: p, name="epoch").csv_log(tmp_path / "m.csv")

    def named_step(state):
        return "continue", state.replace(metrics={**state.metrics, "step": 0.5})

    start = {"n": jnp.float32(0.0), "loss": jnp.float32(0.0)}
    loop = _counter_loop().handle_event("epoch_completed", named_step)
    with pytest.raises(ValueError, match=r"a metric is named 'step'"):
        loop.csv_log(tmp_path / "m.csv").run([(0, 0)], start, epochs=2)


def test_a_second_csv_writer_on_one_file_is_refused_and_a_shared_logdir_warns_on_resume(
    tmp_path,
):
    # Two CSV writers rewrote each other's rows. Two TensorBoard writers of one logdir:
    # a resume's purge (at the epoch's step) hid the iteration writer's earlier points.
    loop = _counter_loop().csv_log(tmp_path / "m.csv")
    with pytest.raises(ValueError, match=r"another csv_log of this loop writes that file"):
        loop.csv_log(tmp_path / "." / "m.csv", event="iteration_completed")
    start = {"n": jnp.float32(0.0), "loss": jnp.float32(0.0)}
    shared = _counter_loop().tensorboard(tmp_path / "tb")
    shared = shared.tensorboard(tmp_path / "tb", event="iteration_completed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh run writes both as asked
        saved = shared.run([(0, 0)] * 2, start, epochs=2)
    with pytest.warns(UserWarning, match=r"count steps apart .* own logdir"):
        shared.run([(0, 0)] * 2, saved, epochs=3)


def test_writer_arguments_are_checked():
    with pytest.raises(ValueError, match="path"):
        _counter_loop().csv_log("")
    with pytest.raises(ValueError, match="event"):
        _counter_loop().tensorboard("tb", event="sometimes")


def test_a_log_stream_that_is_not_a_text_stream_is_named_when_the_loop_is_built(tmp_path):
    model = fl.models.mlp([3])
    with pytest.raises(ValueError, match=r"log_stream='train.log' must be a text stream open"):
        fl.trainer(model, "mean_squared_error", "sgd", log=2, log_stream="train.log")
    (tmp_path / "read.log").write_text("")
    unwritable = r"log_stream=.* open for writing"  # like sys.stdin: it has .write
    with open(tmp_path / "read.log") as read_only, pytest.raises(ValueError, match=unwritable):
        fl.trainer(model, "mean_squared_error", "sgd", log=2, log_stream=read_only)
    with open(tmp_path / "binary.log", "wb") as binary:
        with pytest.raises(ValueError, match=r"log_stream=.*binary mode.*open\(path, 'w'\)"):
            fl.trainer(model, "mean_squared_error", "sgd", log=2, log_stream=binary)
        with pytest.raises(ValueError, match=r"stream=.*binary mode"):
            _counter_loop().log(lambda s: "x\n", stream=binary)
    # A stream with logging off (log=0, the default) would stay empty.
    with pytest.raises(ValueError, match=r"log=0 writes no log lines: pass log=N"):
        fl.trainer(model, "mean_squared_error", "sgd", log_stream=io.StringIO())


def test_a_seed_beyond_64_bits_is_named_when_the_loop_is_built():
    model = fl.models.mlp([3])
    for seed in (2**64, -(2**70), np.uint64(2**63)):
        with pytest.raises(ValueError, match=r"seed=.* must be in \[-2\*\*63"):
            fl.trainer(model, "mean_squared_error", "sgd", seed=seed)


def test_a_seed_beyond_32_bits_without_x64_is_refused_naming_the_seed_it_would_be():
    """Without x64, JAX keys a seed by its low 32 bits: 2**32 + 7 trained as 7."""
    model = fl.models.mlp([3])
    with pytest.raises(ValueError, match=r"seed=4294967303 .* exactly as seed=7"):
        fl.trainer(model, "mean_squared_error", "sgd", seed=2**32 + 7)
    with pytest.raises(ValueError, match=r"outside \[-2\*\*31, 2\*\*32\)"):
        fl.trainer(model, "mean_squared_error", "sgd", seed=-(2**31) - 1)
    for seed in (2**32 - 1, -(2**31)):
        fl.trainer(model, "mean_squared_error", "sgd", seed=seed)
    with jax.enable_x64(True):  # where a seed keys all 64 of its bits
        built_under_x64 = fl.trainer(model, "mean_squared_error", "sgd", seed=2**32 + 7)
    batches = [(np.ones((2, 2), np.float32), np.zeros((2, 3), np.float32))]
    with pytest.raises(ValueError, match=r"exactly as seed=7"):  # run without it
        built_under_x64.run(batches)


def test_numpy_integers_are_accepted_for_log_and_seed():
    stream = io.StringIO()
    model = fl.models.mlp([3])
    plain = fl.trainer(model, "mean_squared_error", "sgd", log=1, seed=0, log_stream=stream)
    batches = [(np.ones((2, 2), np.float32), np.zeros((2, 3), np.float32))]
    loop = fl.trainer(
        model, "mean_squared_error", "sgd", log=np.int64(1), seed=np.int32(0), log_stream=stream
    )
    numpy_params = loop.run(batches).params
    assert stream.getvalue().startswith("Epoch 1/1 - iteration 1 - loss: ")
    assert_tree_equal(numpy_params, plain.run(batches).params)
    with pytest.raises(ValueError, match="log=True must be a non-negative int"):
        fl.trainer(model, "mean_squared_error", "sgd", log=True)


# ----------------------------------------------------------------- plot


def test_plot_history_writes_a_png(written, tmp_path):
    _, state = written[False]
    path = fl.plot_history(state.history, tmp_path / "plots" / "history.png", title="demo")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 600 and height > 200  # two panels (loss, accuracy) side by side
    assert fl.plot_history(state, tmp_path / "again.png", metrics=["loss"]).exists()


def test_plot_history_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="history"):
        fl.plot_history({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="metrics"):
        fl.plot_history({0: {"loss": 1.0}}, tmp_path / "x.png", metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"metrics=\[\] names no metric.*scalar metric: loss"):
        fl.plot_history({0: {"loss": 1.0}}, tmp_path / "x.png", metrics=[])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"fuseloop\[plot\]"):
        fl.plot_history({0: {"loss": 1.0}}, tmp_path / "x.png")


def test_plot_history_writes_the_format_its_path_names_and_takes_one_metric_name(tmp_path):
    history = {0: {"loss": 1.0, "accuracy": 0.5}, 1: {"loss": 0.5, "accuracy": 0.7}}
    assert fl.plot_history(history, tmp_path / "h.pdf").read_bytes()[:4] == b"%PDF"
    assert b"<svg" in fl.plot_history(history, tmp_path / "h.svg").read_bytes()[:400]
    assert fl.plot_history(history, tmp_path / "one.png", metrics="accuracy").exists()
    # A population's metric (one value per member) was refused by its own name.
    members = {e: {"loss": np.array([1.0, 2.0]) / (e + 1)} for e in range(3)}
    assert fl.plot_history(members, tmp_path / "members.png", metrics="loss").exists()
    from fuseloop.handlers.plot import _panels

    assert list(_panels(members, ["loss"])) == ["loss[0]", "loss[1]"]
    both = {0: {"loss": 1.0, "loss[0]": 2.0, "loss[1]": 3.0}}  # a name of its own wins
    assert list(_panels(both, ["loss"])) == ["loss"]
    with pytest.raises(ValueError, match=r"writes no \.xyz files.*\.png"):
        fl.plot_history(history, tmp_path / "h.xyz")
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        fl.plot_history(history, tmp_path)
    assert not (tmp_path / "h.xyz").exists()


def test_plot_history_takes_a_validation_name_as_that_split_alone():
    from fuseloop.handlers.plot import _panels

    history = {0: {"loss": 1.0, "validation_loss": 2.0}, 1: {"loss": 0.5}}
    assert _panels(history, ["validation_loss"]) == {"validation_loss": {"validation": [(1, 2.0)]}}
    assert set(_panels(history, ["loss"])["loss"]) == {"training", "validation"}
    with pytest.raises(ValueError, match="accepted values: loss, validation_loss"):
        _panels(history, ["validation_accuracy"])


def test_plot_numbers_epochs_from_1():
    from fuseloop.handlers.plot import _series

    panels = _series({0: {"loss": 1.0, "validation_loss": 2.0}, 1: {"loss": 0.5}})
    assert panels == {"loss": {"training": [(1, 1.0), (2, 0.5)], "validation": [(1, 2.0)]}}


@pytest.mark.parametrize("fuse", [False, 3])
def test_the_epoch_an_earlier_handler_halts_at_is_still_written(tmp_path, fuse):
    """early_stop attached before the writers (as handlers.md attaches it) halts at the end
    of epoch 1; the writers, which that event's later handlers are, still get its row, as
    Keras's CSVLogger writes the epoch its EarlyStopping ends. A filter still applies."""
    halting = TRAINER.handle_event(
        "epoch_completed", lambda s: "halt_loop" if s.epoch == 1 else None
    )
    loop = _with_writers(halting, tmp_path).csv_log(tmp_path / "odd.csv", filter={"every": 2})
    state = loop.run(DATA, epochs=4, fuse=fuse)
    assert sorted(state.history) == [0, 1]
    with open(tmp_path / "epochs.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["epoch"] for row in rows] == ["0", "1"]
    assert float(rows[1]["loss"]) == state.history[1]["loss"]
    epoch_steps = sorted({step for tag, step, _ in _scalars(tmp_path / "tb") if "epoch/" in tag})
    assert epoch_steps == [0, 1]
    with open(tmp_path / "odd.csv", newline="") as handle:  # every=2: epoch 0 only
        assert [row["epoch"] for row in csv.DictReader(handle)] == ["0"]
    # A loop halting at its first epoch, run twice: the second run writes its row too.
    first = TRAINER.handle_event("epoch_completed", lambda s: "halt_loop")
    first = first.csv_log(tmp_path / "first.csv")
    for _ in range(2):
        first.run(DATA, epochs=3, fuse=fuse)
        with open(tmp_path / "first.csv", newline="") as handle:
            assert [row["epoch"] for row in csv.DictReader(handle)] == ["0"]


def test_a_handlers_bfloat16_and_bool_metrics_are_written_and_plotted(tmp_path):
    """A mixed-precision handler's bf16 scalar (numpy does not call bfloat16 a number) and
    a bool flag are in the history and the log, so the CSV, TensorBoard and the plot keep
    them too rather than dropping them without a word."""

    def add(state):
        leaves = jax.tree.leaves(state.params)
        norm = jnp.sqrt(sum(jnp.sum(p.astype(jnp.bfloat16) ** 2) for p in leaves))
        metrics = {**state.metrics, "pnorm": norm, "flag": np.bool_(True)}
        return "continue", state.replace(metrics=metrics)

    loop = fl.trainer(MODEL, "sparse_categorical_cross_entropy", "adam").handle_event(
        "epoch_completed", add
    )
    state = loop.csv_log(tmp_path / "m.csv").run(DATA, epochs=2)
    with open(tmp_path / "m.csv") as written:
        rows = list(csv.DictReader(written))
    written_norms = [float(row["pnorm"]) for row in rows]
    assert written_norms == [float(h["pnorm"]) for h in state.history.values()]
    assert [row["flag"] for row in rows] == ["1.0", "1.0"]
    fl.plot_history(state.history, tmp_path / "p.png", metrics=["pnorm", "flag"])
    assert (tmp_path / "p.png").stat().st_size > 0
