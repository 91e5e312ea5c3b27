"""save_state / load_state, Loop.checkpoint, resume, and a save killed mid-write."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import make_batches, trainer
from fuseloop._checkpoint import is_save
from fuseloop.handlers.checkpoint import Checkpointer, list_checkpoints


def _batches(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, size=(8,)).astype(np.int32))
        for _ in range(n)
    ]


def _flat(y_true, y_pred):
    return jnp.float32(1.0)  # a plateau: makes the LR handler act every epoch


MODEL = fl.models.mlp([8, 3])
DATA, VAL = _batches(5, 0), _batches(3, 1)
# Every handler whose state must survive a checkpoint: validation metrics in the history,
# the early-stop record, the LR-on-plateau record and the learning rate it changed.
TRAINER = (
    fl.trainer(MODEL, "sparse_categorical_cross_entropy", "adam")
    .metric("accuracy")
    .metric(_flat, "flat")
    .validate(MODEL, VAL)
    .early_stop("validation_loss", patience=10)
    .reduce_lr_on_plateau("validation_flat", factor=0.5, patience=1)
)


def _assert_trees_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _counts(state: fl.State) -> dict:
    return {
        k: v for k, v in state.event_counts.items() if k not in ("started", "completed", "halted")
    }


def _assert_same_run(a: fl.State, b: fl.State):
    _assert_trees_identical(a.step_state, b.step_state)
    assert a.history == b.history
    assert a.handler_metadata == b.handler_metadata
    assert _counts(a) == _counts(b)
    assert (a.epoch, a.iteration, a.status) == (b.epoch, b.iteration, b.status)


# ----------------------------------------------------------------- save / load


def test_save_and_load_round_trip_the_whole_state(tmp_path):
    state = TRAINER.run(DATA, epochs=2)
    fl.save_state(state, tmp_path / "one")
    loaded = fl.load_state(tmp_path / "one")
    _assert_trees_identical(loaded.step_state, state.step_state)
    # optax NamedTuples come back as themselves, so the optimizer accepts the state.
    assert type(loaded.step_state["opt_state"]) is type(state.step_state["opt_state"])
    for name in (
        "epoch",
        "max_epoch",
        "iteration",
        "max_iteration",
        "metrics",
        "history",
        "handler_metadata",
        "event_counts",
        "status",
        "times",
    ):
        assert getattr(loaded, name) == getattr(state, name), name
    optax.apply_updates(
        loaded.params["params"], jax.tree.map(jnp.zeros_like, loaded.params["params"])
    )


def test_save_state_replaces_a_save_but_nothing_else(tmp_path):
    first = fl.State(epoch=1, step_state={"w": jnp.arange(3.0)})
    second = fl.State(epoch=2, step_state={"w": jnp.arange(4.0)})
    fl.save_state(first, tmp_path / "s")
    fl.save_state(second, tmp_path / "s")
    assert fl.load_state(tmp_path / "s").epoch == 2
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary left behind
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a fuseloop save"):
        fl.save_state(first, tmp_path / "user")
    assert (tmp_path / "user" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="does not exist"):
        fl.load_state(tmp_path / "missing")
    with pytest.raises(ValueError, match="no complete save"):
        fl.load_state(tmp_path / "user")
    # No path at all: named, not pathlib's TypeError (an empty string would be the cwd).
    for call in (
        lambda: fl.save_state(first, None),
        lambda: fl.load_state(""),
        lambda: list_checkpoints(None),
    ):
        with pytest.raises(ValueError, match=r"path=(None|'') must be a path"):
            call()


def test_custom_step_states_keep_python_scalars_and_typed_keys(tmp_path):
    eqx = pytest.importorskip("equinox")
    step_state = {
        "key": jax.random.key(3),
        "scale": 0.5,
        "n": np.int64(7),
        "nested": (jnp.ones(2, jnp.bfloat16), None),
        "module": eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0)),
    }
    fl.save_state(fl.State(step_state=step_state), tmp_path / "s")
    loaded = fl.load_state(tmp_path / "s").step_state
    # An equinox module (whose tree structure does not survive pickling a PyTreeDef).
    assert jax.tree.structure(loaded["module"]) == jax.tree.structure(step_state["module"])
    np.testing.assert_array_equal(loaded["module"].weight, step_state["module"].weight)
    assert loaded["scale"] == 0.5 and type(loaded["scale"]) is float
    assert loaded["n"].dtype == np.int64 and loaded["nested"][1] is None
    assert loaded["nested"][0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        jax.random.key_data(loaded["key"]), jax.random.key_data(step_state["key"])
    )


# ----------------------------------------------------------------- Loop.checkpoint


def _counting(values):
    def script(state):
        return "continue", state.replace(metrics={**state.metrics, "score": values[state.epoch]})

    return fl.loop(lambda b, s: {"n": s["n"] + 1}).handle_event("epoch_completed", script)


def test_checkpoint_directory_keep_and_latest(tmp_path):
    loop = _counting([0.0] * 5).checkpoint(tmp_path / "ck", keep=2)
    loop.run([(0, 0)], {"n": jnp.int32(0)}, epochs=5)
    saves = list_checkpoints(tmp_path / "ck")
    assert [fl.load_state(p).epoch for p in saves] == [3, 4]
    latest = fl.load_state(tmp_path / "ck")
    assert latest.epoch == 4 and int(latest.step_state["n"]) == 5
    assert sorted(latest.history) == [0, 1, 2, 3, 4]


def test_checkpoint_on_best_saves_only_improvements(tmp_path):
    values = [3.0, 2.0, 2.5, 1.0, 1.5]
    loop = _counting(values).checkpoint(tmp_path / "best", criteria="score", mode="min")
    state = loop.run([(0, 0)], {"n": jnp.int32(0)}, epochs=5)
    saved = [fl.load_state(p).epoch for p in list_checkpoints(tmp_path / "best")]
    assert saved == [0, 1, 3]
    assert state.handler_metadata["checkpoint:score"]["best"] == 1.0
    # The record inside a checkpoint is the one that checkpoint made.
    assert fl.load_state(tmp_path / "best").handler_metadata["checkpoint:score"]["best"] == 1.0
    with pytest.raises(ValueError, match="mode"):
        loop.checkpoint(tmp_path, criteria="score", mode="lowest")
    with pytest.raises(ValueError, match="keep"):
        loop.checkpoint(tmp_path, keep=0)
    with pytest.raises(ValueError, match="keep"):
        loop.checkpoint(tmp_path, keep=2.0)
    with pytest.raises(ValueError, match=r"^criteria='val_score' is not among"):
        _counting(values).checkpoint(tmp_path / "v", criteria="val_score").run(
            [(0, 0)], {"n": jnp.int32(0)}
        )


def test_a_halted_run_saves_its_final_state(tmp_path):
    # Early stopping halts before the checkpoint handler of that epoch runs; the final
    # State is saved when the run halts.
    loop = _counting([3.0, 2.0, 2.5, 2.6, 1.0]).early_stop("score", patience=2)
    state = loop.checkpoint(tmp_path / "es").run([(0, 0)], {"n": jnp.int32(0)}, epochs=5)
    assert state.status == "halted" and max(state.history) == 3
    saved = [fl.load_state(p) for p in list_checkpoints(tmp_path / "es")]
    assert [s.epoch for s in saved] == [0, 1, 2, 3]
    assert saved[-1].handler_metadata == state.handler_metadata
    assert saved[-1].status == "halted"


def test_a_loop_run_again_saves_its_own_final_state_and_reads_the_directory_afresh(tmp_path):
    # The second run halts where the first did (epoch 1, the same iteration count) from
    # another start: its final State is its own, and a directory emptied between the runs
    # is numbered from 1 again.
    halting = _counting([0.0] * 5).handle_event(
        "epoch_completed", lambda s: "halt_loop", {"once": 2}
    )
    loop = halting.checkpoint(tmp_path / "ck", filter={"after": 10})
    first = loop.run([(0, 0)], {"n": jnp.int32(0)}, epochs=5)
    with pytest.warns(UserWarning, match=r"already holds 1 checkpoint\(s\) this run did not"):
        second = loop.run([(0, 0)], {"n": jnp.int32(100)}, epochs=5)
    assert (first.epoch, second.epoch) == (1, 1)
    assert int(fl.load_state(tmp_path / "ck").step_state["n"]) == 102
    for save in list_checkpoints(tmp_path / "ck"):
        shutil.rmtree(save)
    loop.run([(0, 0)], {"n": jnp.int32(200)}, epochs=5)
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["checkpoint_000001_epoch_1"]


def test_a_fresh_run_into_another_runs_checkpoints_is_warned_a_resumed_one_is_not(tmp_path):
    """A script run again, or another model, into the same directory: its saves were
    numbered after the earlier run's and `keep` removed those, without a word."""
    loop = trainer().checkpoint(tmp_path / "ck", keep=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = loop.run(make_batches(), epochs=2)
        loop.run(make_batches(), state, epochs=3)  # resumed: its own run's saves
    with pytest.warns(UserWarning, match=r"holds 2 checkpoint.*keep=2 removes the oldest"):
        loop.run(make_batches(), epochs=1)


def test_a_signal_still_writes_a_checkpoint(tmp_path):
    def interrupt(state):
        if state.epoch == 1 and state.iteration == 1:
            os.kill(os.getpid(), signal.SIGINT)

    loop = (
        _counting([0.0] * 4)
        .handle_event("iteration_completed", interrupt)
        .checkpoint(tmp_path / "sig")
    )
    state = loop.run([(0, 0)] * 3, {"n": jnp.int32(0)}, epochs=4)
    assert state.status == "halted"
    latest = fl.load_state(tmp_path / "sig")
    assert latest.status == "halted" and latest.epoch == 1
    assert int(latest.step_state["n"]) == int(state.step_state["n"]) == 5


def test_checkpoint_needs_a_step_state(tmp_path):
    loop = TRAINER.checkpoint(tmp_path / "it", event="iteration_completed")
    with pytest.raises(ValueError, match="epoch event"):
        loop.run(DATA[:3], epochs=1, fuse=3)


# ----------------------------------------------------------------- resume


@pytest.mark.parametrize("fuse", [False, 3])
def test_resume_from_an_epoch_end_checkpoint_is_bitwise_identical(tmp_path, fuse):
    loop = TRAINER.checkpoint(tmp_path / "full")
    full = loop.run(DATA, epochs=4, fuse=fuse)
    middle = fl.load_state(list_checkpoints(tmp_path / "full")[1])
    assert middle.epoch == 1 and sorted(middle.history) == [0, 1]
    resumed = loop.run(DATA, middle, epochs=4, fuse=fuse)
    _assert_same_run(resumed, full)
    rates = [s.step_state["opt_state"].hyperparams["learning_rate"] for s in (full, middle)]
    assert float(rates[0]) < float(rates[1])  # the learning rate changed after the resume


def test_an_interrupted_run_resumes_from_its_checkpoint_directory(tmp_path):
    loop = TRAINER.checkpoint(tmp_path / "run", keep=1)
    loop.run(DATA, epochs=2, fuse=3)  # "killed" after two epochs
    resumed = loop.run(DATA, fl.load_state(tmp_path / "run"), epochs=4, fuse=3)
    _assert_same_run(resumed, TRAINER.run(DATA, epochs=4, fuse=3))
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint_000004_epoch_3"]


# ----------------------------------------------------------------- killed while saving

_SAVER = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    import fuseloop as fl
    from fuseloop.handlers.checkpoint import Checkpointer

    path, first = sys.argv[1], int(sys.argv[2])
    saver = Checkpointer(path, keep=2)
    for i in range(first, first + 10_000):
        state = fl.State(epoch=i, history={e: {"loss": float(e)} for e in range(i + 1)},
                         step_state={"w": jnp.full((512, 512), i, jnp.float32),
                                     "i": jnp.int32(i)})
        saver.save(state)
        print(i, flush=True)
""")


def _save_until_killed(script, path, first: int, delay: float) -> int:
    """Runs the saver, kills it with SIGKILL `delay` seconds after its second save, and
    returns the last epoch it reported saved."""
    process = subprocess.Popen(
        [sys.executable, str(script), str(path), str(first)], stdout=subprocess.PIPE, text=True
    )
    try:
        reported = [int(process.stdout.readline()) for _ in range(2)]
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        rest = process.stdout.read()
    finally:
        process.kill()
        process.wait()
    return max(reported + [int(line) for line in rest.split()])


def test_a_save_killed_mid_write_leaves_the_last_good_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    path = tmp_path / "ck"
    rng = random.Random(0)
    first = 0
    for _ in range(3):
        last = _save_until_killed(script, path, first, rng.uniform(0.0, 0.3))
        loaded = fl.load_state(path)
        # The latest complete save loads: the last one reported, or one finished after it
        # whose report the kill cut off.
        assert loaded.epoch in (last, last + 1)
        assert int(loaded.step_state["i"]) == loaded.epoch
        assert np.all(np.asarray(loaded.step_state["w"]) == loaded.epoch)
        assert sorted(loaded.history) == list(range(loaded.epoch + 1))
        # Nothing under a checkpoint name is partial.
        named = [p for p in path.iterdir() if p.name.startswith("checkpoint_")]
        assert named and all(is_save(p) for p in named)
        first = loaded.epoch + 1
    # A new writer cleans up what dead writers left behind and continues the numbering.
    saver = Checkpointer(path, keep=2)
    saver.save(fl.State(epoch=first, step_state={"i": jnp.int32(first)}))
    assert not [p for p in path.iterdir() if p.name.startswith(".")]
    assert fl.load_state(path).epoch == first


def test_the_handler_modules_the_docs_call_resolve_in_a_fresh_process(tmp_path):
    """`fl.handlers.checkpoint.list_checkpoints(path)` (docs/handlers.md) right after
    `import fuseloop`: the submodules load on first use; it raised AttributeError unless a
    Loop had attached a checkpoint before."""
    fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd").checkpoint(
        tmp_path
    ).run(_batches(2, 0), epochs=2)
    script = (
        "import sys, fuseloop as fl; "
        "print(len(fl.handlers.checkpoint.list_checkpoints(sys.argv[1])), "
        "callable(fl.handlers.progress.write_above_bars))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "True"]


def test_states_compare_by_value_and_print_a_summary():
    import copy
    import pickle

    loop = fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "adam")
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(4, 3)).astype(np.float32), rng.integers(0, 3, 4)) for _ in range(3)]
    state = loop.run(data, epochs=2)
    # A copy and a pickle round trip are the same State; one changed value is not.
    assert pickle.loads(pickle.dumps(state)) == state == copy.deepcopy(state)
    assert state.replace(epoch=5) != state
    changed = jax.tree.map(lambda a: a + 1, state.step_state)
    assert state.replace(step_state=changed) != state
    nan = state.replace(metrics={"loss": float("nan")})
    assert nan == nan.replace()  # NaN equals NaN, as two histories of the same run do
    text = repr(state)
    assert len(text) < 400 and "step_state=<" in text and "epoch=1" in text
    # A population's metrics (one value per member) by shape and range, not every value.
    members = state.replace(metrics={"loss": np.linspace(0.5, 2.0, 256), "lr": 0.1})
    assert "'loss': <(256,) 0.5..2>, 'lr': 0.1" in repr(members) and len(repr(members)) < 400


def test_a_mode_without_criteria_is_refused(tmp_path):
    # mode says which way criteria improves: alone, it would be ignored in silence.
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    with pytest.raises(ValueError, match=r"mode='max'.*no criteria is given.*criteria="):
        loop.checkpoint(tmp_path, mode="max")
    loop.checkpoint(tmp_path, mode="min")  # the default, said out loud: fine


def test_a_state_that_cannot_be_saved_is_refused_before_orbax_opens_a_manager(tmp_path):
    """A custom step state holding a function (a flax TrainState's apply_fn) is refused
    with its name; orbax's manager, once opened for it and never closed, printed a
    traceback at interpreter exit."""
    saver = Checkpointer(tmp_path / "ck")
    state = fl.State(step_state={"apply_fn": lambda x: x, "w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"apply_fn"):
        saver.save(state)
    assert saver._manager is None and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("builder", ["checkpoint", "validate"])
@pytest.mark.parametrize("fuse", [3, "run"])
def test_step_state_readers_on_iteration_events_refuse_a_fused_run_before_it_steps(
    tmp_path, builder, fuse
):
    batches = make_batches(n=5)
    data = fl.data.arrays(
        np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches]), 4
    )
    if builder == "checkpoint":
        loop = trainer().checkpoint(tmp_path, event="iteration_completed", filter={"every": 3})
    else:
        loop = trainer().validate(trainer().program.model, batches[:2], "iteration_completed")
    seen = []
    loop = loop.handle_event("started", lambda state: seen.append(state.step_state))
    refused = f"{builder} on 'iteration_completed' reads the step state.*fuse=False"
    with pytest.raises(fl.FusionError, match=refused):
        loop.run(data, epochs=2, fuse=fuse)
    assert seen == [] and list_checkpoints(tmp_path) == []  # refused before the run began
    state = loop.run(data, epochs=2)  # unfused, each firing has its step state
    if builder == "checkpoint":
        assert list_checkpoints(tmp_path)
    else:
        assert "validation_loss" in state.metrics


def test_a_function_that_only_holds_a_checkpointer_is_no_step_state_reader(tmp_path):
    saver = Checkpointer(tmp_path)
    paths = []

    def where(state: fl.State) -> None:  # reads the saver's path, never the step state
        paths.append(saver.path)

    state = trainer().handle_event("iteration_completed", where).run(make_batches(n=4), fuse=2)
    assert state.status == "completed" and len(paths) == 4
