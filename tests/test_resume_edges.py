"""Resuming from States a trainer cannot continue, saves it cannot find, and runs with
nothing left to train: each says what it is, and nothing the user had is lost. A State
taken inside an epoch resumes with the uninterrupted run's counts (so `every=` schedules)
and says it cannot continue that run exactly; no save is read in place of the latest
checkpoint."""

from __future__ import annotations

import collections
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import make_batches, trainer
from fuseloop.handlers.checkpoint import list_checkpoints


def _data(device: bool = False) -> fl.data.ArraySource:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5)).astype(np.float32)
    y = rng.integers(0, 3, 24).astype(np.int32)
    return fl.data.arrays(x, y, batch_size=8, device=device)


def _trainer() -> fl.Loop:
    model = fl.models.mlp([8, 3])
    return fl.trainer(model, "sparse_categorical_cross_entropy", "adam").metric("accuracy")


# One Loop per configuration for the tests that need no fresh one: a new Loop traces and
# lowers its programs again even where the compile cache holds them.
_MLP = _trainer()
_TINY = trainer()


def test_a_trainer_given_an_evaluators_state_names_init_state_and_the_fix():
    data, trainer = _data(), _MLP
    trained = trainer.run(data, epochs=1)
    scored = fl.evaluator(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy").run(
        data, trained
    )
    with pytest.raises(ValueError, match=r"init_state: .*opt_state, rng, step.*state\.params"):
        trainer.run(data, scored, epochs=2)
    trainer.run(data, scored.params, epochs=1)  # the fix it names
    # A custom loop's State holds no params: it failed with KeyError('params') inside.
    custom = fl.loop(lambda batch, s: {"n": s["n"] + 1}).run(data, {"n": np.int32(0)})
    with pytest.raises(ValueError, match=r"holds \['n'\], not the params, .*afresh"):
        trainer.run(data, custom, epochs=2)
    # The State's step state, not the State: it was read as the model's variables, and
    # the error blamed the model's missing train flag.
    step_state = r"this dict holds \['opt_state', 'params', 'rng', 'step'\], a trainer's step"
    with pytest.raises(ValueError, match=step_state):
        trainer.run(data, trained.step_state, epochs=2)
    with pytest.raises(ValueError, match=step_state):
        fl.evaluator(fl.models.mlp([8, 3])).run(data, trained.step_state)
    # Ctrl-C while a run starts leaves a State without a step state (error.fuseloop_state).
    with pytest.raises(ValueError, match=r"init_state: this State holds no step state"):
        trainer.run(data, fl.State(), epochs=2)


def test_a_save_of_a_state_without_its_step_state_is_refused_naming_why(tmp_path):
    """Mid-chunk the step state is on the device, and after a dispatch of several epochs
    an observer's State has none either: a save of one wrote a checkpoint no run could
    resume from, and only the resume said so (blaming Ctrl-C or the iteration handler)."""
    refused = []

    def save(state: fl.State) -> None:
        try:
            fl.save_state(state, tmp_path / f"s{len(refused)}")
        except ValueError as error:
            refused.append(str(error))

    trainer, data = _MLP, _data()
    trainer.handle_event("iteration_completed", save, filter={"once": 1}).run(data, fuse=3)
    trainer.observe("epoch_completed", save).run(_data(device=True), epochs=2, fuse="run")
    assert len(refused) == 2 and all("holds no step state" in e for e in refused)
    assert "Loop.handle_event" in refused[0] and "Loop.checkpoint(path)" in refused[0]
    # Written: only the dispatch's last epoch, which fires live, with its step state.
    assert [path.name for path in tmp_path.iterdir()] == ["s2"]
    with pytest.raises(ValueError, match=r"no step state.*an observer after a dispatch"):
        trainer.run(data, fl.State(epoch=1), epochs=2)


def test_loading_a_populations_best_checkpoint_folder_names_its_members(tmp_path):
    # The population tests' trainer, data and run (population=2, fuse=4): their programs.
    from test_population_members import _data as _population_data
    from test_population_members import _trainer as _population_trainer

    folder = tmp_path / "best"
    best = _population_trainer().checkpoint(folder, criteria="loss")
    best.run(_population_data(), epochs=2, fuse=4, population=2)
    with pytest.raises(ValueError, match=r"one folder per member \(member_0, member_1\)"):
        fl.load_state(folder)
    assert fl.load_state(folder / "member_0").history


def test_a_resume_with_nothing_left_to_train_keeps_the_metrics():
    data, trainer = _data(), _MLP
    done = trainer.run(data, epochs=2)
    with pytest.warns(RuntimeWarning, match="nothing is trained"):
        again = trainer.run(data, done, epochs=2)
    assert again.metrics == done.metrics and again.history == done.history


_BATCHES = make_batches(4)
_X = np.concatenate([b[0] for b in _BATCHES])
_Y = np.concatenate([b[1] for b in _BATCHES])


def _shuffled() -> fl.data.ArraySource:
    return fl.data.arrays(_X, _Y, batch_size=len(_BATCHES[0][1]), seed=1)


def test_a_checkpoint_taken_mid_epoch_warns_and_the_resumed_run_keeps_the_counts(tmp_path):
    loop = _TINY
    full = loop.run(_shuffled(), epochs=3)
    every = loop.checkpoint(tmp_path, event="iteration_completed", filter={"every": 3})
    every.run(_shuffled(), epochs=2)
    saved = fl.load_state(tmp_path)  # the 7th iteration's (1, 4, 7): still running
    assert (saved.status, saved.epoch, saved.iteration) == ("running", 1, 2)
    with pytest.warns(
        RuntimeWarning, match=r"inside epoch 1 \(status 'running'\) after stepping 3"
    ):
        resumed = loop.run(_shuffled(), saved, epochs=3)
    assert resumed.event_counts == full.event_counts


def test_a_run_resumed_from_its_epoch_started_checkpoint_keeps_the_schedule(tmp_path):
    def crash_in_epoch_4(state: fl.State) -> None:
        if state.epoch == 4:
            raise KeyError("preempted")

    def saving(directory: object) -> fl.Loop:
        return _TINY.checkpoint(directory, event="epoch_started", filter={"every": 3})

    full = saving(tmp_path / "full").run(_shuffled(), epochs=7)
    with pytest.raises(KeyError, match="preempted"):
        saving(tmp_path / "cut").handle_event("epoch_completed", crash_in_epoch_4).run(
            _shuffled(), epochs=7
        )
    saved = fl.load_state(tmp_path / "cut")  # taken at epoch 3's start
    resumed = saving(tmp_path / "cut").run(_shuffled(), saved, epochs=7)
    assert resumed.event_counts == full.event_counts
    epochs = [path.name.rsplit("_", 1)[1] for path in list_checkpoints(tmp_path / "cut")]
    assert epochs == ["0", "3", "3", "6"]  # epoch 3 started twice; epoch 6 as uninterrupted


def test_a_checkpoint_directory_that_is_a_save_or_under_a_file_is_refused(tmp_path):
    saved = fl.save_state(_TINY.run(_BATCHES), tmp_path / "save")
    with pytest.raises(ValueError, match=r"is a save written by fl.save_state, not a checkp"):
        _TINY.checkpoint(saved)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"is a file, so no save can be made there"):
        fl.save_state(fl.load_state(saved), tmp_path / "a_file" / "save")


def test_a_state_in_another_dtype_than_the_model_makes_is_warned_of_with_the_fix():
    # A bfloat16 State resumed by a model now built with float32 params trained on in
    # bfloat16 without a word. It may also be the resume of variables cast on purpose
    # (which train as given), so it is a warning, given on every such resume.
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Dense(nn.Module):
        param_dtype: object

        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3, param_dtype=self.param_dtype)(x)

    def trainer(param_dtype):
        return fl.trainer(Dense(param_dtype), "sparse_categorical_cross_entropy", "adam")

    data = _data()
    narrow, wider = trainer(jnp.bfloat16), trainer(jnp.float32)
    saved = narrow.run(data, epochs=1)
    for _ in range(2):  # a Loop's second resume says it again
        with pytest.warns(
            RuntimeWarning,
            match=r"init_state: the State holds \['params'\]\['Dense_0'\]\['bias'\] as "
            r"bfloat16 where the model makes it float32.*param_dtype.*astype\(jnp\.float32\) if",
        ):
            resumed = wider.run(data, saved, epochs=2)
        assert jax.tree.leaves(resumed.params)[0].dtype == jnp.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert narrow.run(data, saved, epochs=2).epoch == 1  # same dtypes
        as_given = wider.run(data, saved.params)  # a deliberate cast: trained as given
    assert jax.tree.leaves(as_given.params)[0].dtype == jnp.bfloat16
    cast = jax.tree.map(lambda a: a.astype(jnp.float32), saved.params)  # the fix it names
    assert jax.tree.leaves(wider.run(data, cast).params)[0].dtype == jnp.float32


@pytest.mark.parametrize("how", ["halt_loop", "raise"])
def test_a_fused_halt_at_a_chunks_first_iteration_warns_on_resume(how):
    # The chunk ran whole while none of its iteration_completed fired: the State held 4
    # steps of epoch 1 and its resume repeated them without a word.
    def stop(state: fl.State):
        if (state.epoch, state.iteration) == (1, 0):
            if how == "raise":
                raise RuntimeError("stop here")
            return "halt_loop"
        return None

    def halted(fuse) -> fl.State:
        loop = _MLP.handle_event("iteration_started", stop)
        if how == "halt_loop":
            return loop.run(_data(), epochs=3, fuse=fuse)
        with pytest.raises(RuntimeError, match="stop here") as caught:
            loop.run(_data(), epochs=3, fuse=fuse)
        return caught.value.fuseloop_state

    with pytest.warns(RuntimeWarning, match=r"stopped inside epoch 1 .*after stepping 3 of"):
        _MLP.run(_data(), halted(4), epochs=3, fuse=4)
    with warnings.catch_warnings():  # unfused, the halt came before the step: a clean resume
        warnings.simplefilter("error")
        _MLP.run(_data(), halted(False), epochs=3)


def test_a_resume_from_a_guard_halt_does_not_carry_its_non_finite_note():
    # The note stayed in handler_metadata: a later halt of the resumed run by a handler
    # was reported as "the loss became non-finite" once more.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 5)).astype(np.float32), rng.integers(0, 3, 24).astype(np.int32)
    bad = x.copy()
    bad[20] = np.nan  # the third batch of epoch 0
    with pytest.warns(RuntimeWarning, match="non-finite"):
        halted = _MLP.terminate_on_nan().run(fl.data.arrays(bad, y, 8, shuffle=False))
    loop = _MLP.handle_event("iteration_completed", lambda s: "halt_loop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the resume's "stopped inside"
        resumed = loop.run(fl.data.arrays(x, y, 8), halted.params, epochs=1)
    assert "_nonfinite_at" not in resumed.handler_metadata
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = loop.run(fl.data.arrays(x, y, 8), halted, epochs=1)
    assert "_nonfinite_at" not in again.handler_metadata


def _interrupted_at(epoch: int, batch: int):
    """A callable source of 6 batches an epoch whose `epoch` raises KeyboardInterrupt
    while its `batch` is pulled (a Ctrl-C in the loader)."""
    batches, opened = make_batches(6), [-1]

    def source():
        opened[0] += 1
        for i, b in enumerate(batches):
            if opened[0] == epoch and i == batch:
                raise KeyboardInterrupt("Ctrl-C in the loader")
            yield b

    return source


@pytest.mark.parametrize("fuse", [False, 2, 4])
def test_a_resume_from_a_keyboard_interrupts_state_says_the_steps_it_repeats(fuse):
    # Fused, the chunk launched before the interrupt ran whole, though never replayed: its
    # State counted none of its steps, and a resume trained them twice without a word.
    with pytest.raises(KeyboardInterrupt) as caught:
        _TINY.run(_interrupted_at(1, 3), epochs=3, fuse=fuse)
    state = caught.value.fuseloop_state
    stepped = int(state.step_state["step"])
    assert stepped > 6 * len(state.history)  # steps beyond the epochs completed
    with pytest.warns(RuntimeWarning, match=r"stopped inside epoch \d .* after stepping"):
        _TINY.run(make_batches(6), state, epochs=3, fuse=fuse)


def test_a_resume_from_an_epoch_end_handlers_failure_says_what_did_not_finish():
    # The State an epoch_completed handler raised on has that epoch in its history: a
    # resume starts at the next epoch, so the handlers after it never ran for this one.
    seen: list[int] = []

    def flaky(state):
        if state.epoch == 1 and not seen:
            seen.append(state.epoch)
            raise OSError("the validation files are on a network share that went away")

    loop = _TINY.handle_event("epoch_completed", flaky)
    with pytest.raises(OSError) as caught:
        loop.run(make_batches(4), epochs=3)
    state = caught.value.fuseloop_state
    assert sorted(state.history) == [0, 1]
    with pytest.warns(RuntimeWarning, match=r"did not finish epoch 1 .* checkpoint of epoch 0"):
        resumed = loop.run(make_batches(4), state, epochs=3)
    assert sorted(resumed.history) == [0, 1, 2]
    with warnings.catch_warnings():  # its own States say nothing of it again
        warnings.simplefilter("error")
        loop.run(make_batches(4), resumed, epochs=4)


@pytest.mark.parametrize("fuse", [False, 2])
def test_a_custom_loop_holding_a_typed_key_resumes(fuse):
    # A check of a resumed State's 64-bit leaves read every leaf's numpy dtype; a typed
    # key (jax.random.key) has none, and the resume failed with a TypeError.
    def init_fn(batch, _):
        return {"key": jax.random.key(0), "step": jnp.zeros((), jnp.int32)}

    def step_fn(batch, state):
        key, _ = jax.random.split(state["key"])
        return {"key": key, "step": state["step"] + 1}

    loop = fl.loop(step_fn, init_fn)
    batches = [(np.zeros((2, 1), np.float32), np.zeros(2, np.float32))] * 3
    whole = loop.run(batches, 0, epochs=2, fuse=fuse)
    resumed = loop.run(batches, loop.run(batches, 0, epochs=1, fuse=fuse), epochs=2, fuse=fuse)
    assert int(resumed.step_state["step"]) == int(whole.step_state["step"]) == 6
    same = jax.random.key_data(resumed.step_state["key"]) == jax.random.key_data(
        whole.step_state["key"]
    )
    assert bool(np.all(same))


def test_a_resumed_run_leaves_the_given_states_handler_metadata_as_it_was():
    # The docs' idiom: copy the metadata dict, append to a list kept in it.
    def mark_epoch(state):
        meta = dict(state.handler_metadata)
        meta.setdefault("mine", {"epochs": []})["epochs"].append(state.epoch)
        return "continue", state.replace(handler_metadata=meta)

    def mark_in_a_defaultdict(state):  # a dict of another kind: a defaultdict
        meta = dict(state.handler_metadata)
        meta.setdefault("kept", collections.defaultdict(list))["epochs"].append(state.epoch)
        return "continue", state.replace(handler_metadata=meta)

    def count_epochs(state):  # a Counter: copied as a dict, its values set, not counted
        meta = dict(state.handler_metadata)
        meta["counted"] = collections.Counter(meta.get("counted", {}))
        meta["counted"]["epochs"] += 1
        return "continue", state.replace(handler_metadata=meta)

    loop = trainer().handle_event("epoch_started", mark_epoch)
    loop = loop.handle_event("epoch_started", mark_in_a_defaultdict)
    loop = loop.handle_event("epoch_started", count_epochs)
    data = make_batches(3)
    first = loop.run(data, epochs=1)
    again = loop.run(data, first, epochs=2)
    once_more = loop.run(data, first, epochs=3)
    for key in ("mine", "kept"):
        assert first.handler_metadata[key] == {"epochs": [0]}
        assert again.handler_metadata[key] == {"epochs": [0, 1]}
        assert once_more.handler_metadata[key] == {"epochs": [0, 1, 2]}
    assert [s.handler_metadata["counted"] for s in (first, again, once_more)] == [
        {"epochs": n} for n in (1, 2, 3)
    ]
