"""Log, validate and the progress bar, fused and unfused (issue 4 items 1, 2, 6)."""

from __future__ import annotations

import io
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from fuseloop._metrics import LOSSES
from fuseloop.handlers.log import format_metrics

MODEL = fl.models.mlp([8, 3])
LOSS = "sparse_categorical_cross_entropy"


def _batches(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, size=(8,)).astype(np.int32))
        for _ in range(n)
    ]


DATA, VAL = _batches(5, 0), _batches(3, 1)


def _epoch_line(state: fl.State) -> str:
    return f"[epoch {state.epoch}] {format_metrics(state.metrics)}\n"


LOG = io.StringIO()
LOGGED = (
    fl.trainer(MODEL, LOSS, "adam", log=2, log_stream=LOG)
    .metric("accuracy")
    .validate(MODEL, VAL)
    .early_stop("validation_accuracy", patience=2, mode="max")
    .log(_epoch_line, event="epoch_completed", stream=LOG)
)


def _logged_run(fuse) -> tuple[str, fl.State]:
    LOG.seek(0)
    LOG.truncate()
    state = LOGGED.run(DATA, epochs=8, fuse=fuse)
    return LOG.getvalue(), state


@pytest.fixture(scope="module")
def unfused_reference():
    return _logged_run(False)


def _equal_trees(a, b) -> bool:
    same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(jax.tree.leaves(same))


@pytest.mark.parametrize("fuse", [1, 3, 32])
def test_log_is_byte_identical_with_validation_and_early_stopping(unfused_reference, fuse):
    expected, reference = unfused_reference
    # The scenario is meaningful only if early stopping really cut the run short.
    assert reference.status == "halted" and len(reference.history) < 8
    assert "validation_accuracy" in expected and " - iteration " in expected
    text, state = _logged_run(fuse)
    assert text == expected
    assert state.history == reference.history and state.status == reference.status
    assert _equal_trees(state.step_state, reference.step_state)
    assert state.handler_metadata == reference.handler_metadata


def test_log_goes_to_the_stream_and_checks_its_arguments():
    stream = io.StringIO()
    loop = fl.loop(lambda b, s: {"n": s["n"] + 1})
    loop.log(lambda s: f"{s.iteration};", stream=stream).run([(0, 0)] * 3, {"n": 0})
    assert stream.getvalue() == "0;1;2;"
    with pytest.raises(ValueError, match="str"):
        loop.log(lambda s: None, stream=stream).run([(0, 0)], {"n": 0})
    with pytest.raises(ValueError, match="stream"):
        loop.log(str, stream=42)
    with pytest.raises(ValueError, match="fn"):
        loop.log("not callable")


# ----------------------------------------------------------------- validation

BASE = fl.trainer(MODEL, LOSS, "adam").metric("accuracy")
VALIDATED = BASE.validate(MODEL, VAL)


@pytest.mark.parametrize("fuse", [False, 3])
def test_validation_never_changes_the_training_trajectory(fuse):
    plain = BASE.run(DATA, epochs=2, fuse=fuse)
    validated = VALIDATED.run(DATA, epochs=2, fuse=fuse)
    assert _equal_trees(plain.step_state, validated.step_state)
    for epoch, metrics in plain.history.items():
        assert {
            k: v for k, v in validated.history[epoch].items() if not k.startswith("validation_")
        } == metrics


@jax.jit
def _direct_evaluation(params, x, y):
    """The loss and logits of one batch, computed apart from fuseloop (one jitted program,
    not an eager op each; compared with a tolerance)."""
    logits = MODEL.apply(params, x)
    return LOSSES[LOSS](y, logits), logits


def test_validation_metrics_match_a_direct_evaluation():
    state = VALIDATED.run(DATA, epochs=2)
    assert set(state.metrics) == {
        "loss",
        "learning_rate",  # the named optimizer's rate; not a validation metric
        "accuracy",
        "validation_loss",
        "validation_accuracy",
    }
    assert state.history[1] == state.metrics
    losses, accuracies = [], []
    for x, y in VAL:
        loss, logits = _direct_evaluation(state.params, x, y)
        losses.append(float(loss))
        accuracies.append(float(np.mean(np.argmax(np.asarray(logits), -1) == y)))
    assert state.metrics["validation_loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert state.metrics["validation_accuracy"] == pytest.approx(np.mean(accuracies))


def _validator(loop: fl.Loop):
    return next(r.handler for r in loop.registrations if r.name == "validate")


def test_validation_compiles_once_per_process():
    VALIDATED.run(DATA, epochs=3)
    assert _validator(VALIDATED).loop._programs.traces == 1
    VALIDATED.run(DATA, epochs=2, fuse=3)
    assert _validator(VALIDATED).loop._programs.traces == 1


def test_fused_validation_gives_the_unfused_metrics():
    from fuseloop.handlers.validate import Validator

    params = VALIDATED.run(DATA, epochs=1).params
    fused = Validator(_validator(VALIDATED).loop, VAL, fuse=2).evaluate(params)
    assert fused == _validator(VALIDATED).evaluate(params)
    assert set(fused) == {"loss", "accuracy"}


def test_validation_filter_and_event():
    state = BASE.validate(MODEL, VAL, filter={"every": 2}).run(DATA, epochs=3)
    assert ["validation_loss" in state.history[e] for e in range(3)] == [True, False, True]


def test_validation_arguments_are_checked():
    with pytest.raises(ValueError, match="re-iterable"):
        BASE.validate(MODEL, iter(VAL))
    with pytest.raises(ValueError, match="fuse"):
        BASE.validate(MODEL, VAL, fuse=0)
    with pytest.raises(ValueError, match="event"):
        BASE.validate(MODEL, VAL, event="epoch_ended")
    with pytest.raises(ValueError, match="model"):
        BASE.validate(None, VAL)
    # Keras's (x, y, sample_weight) triples were refused only after the first epoch trained,
    # as "the run's first batch"; whole arrays given as (x, y) likewise.
    triples = [(x, y, np.ones(len(y), np.float32)) for x, y in VAL]
    with pytest.raises(ValueError, match=r"validation data's first batch is a tuple of length 3"):
        BASE.validate(MODEL, triples)
    whole = (np.concatenate([x for x, _ in VAL]), np.concatenate([y for _, y in VAL]))
    with pytest.raises(ValueError, match=r"first batch is a ndarray of shape .* whole arrays"):
        BASE.validate(MODEL, whole)


def _ragged_val() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return rng.normal(size=(21, 4)).astype(np.float32), rng.integers(0, 3, 21).astype(np.int32)


@pytest.mark.parametrize("fuse", [True, 1, 3])
def test_a_fused_validation_of_host_batches_of_two_sizes_is_refused_when_attached(fuse):
    # Found before any training (a fused run would raise at the first epoch's end).
    x, y = _ragged_val()
    short = fl.data.arrays(x, y, batch_size=8, shuffle=False, drop_remainder=False)
    with pytest.raises(fl.FusionError) as info:
        BASE.validate(MODEL, short, fuse=fuse)
    message = str(info.value)
    assert f"validate(fuse={fuse!r})" in message and "holds 5 of its 21 examples" in message
    assert "fuse=False" in message and "device=True" in message
    listed = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 21, 8)]
    with pytest.raises(fl.FusionError, match=r"validation batch 2 holds 5 examples"):
        BASE.validate(MODEL, listed, fuse=fuse)
    BASE.validate(MODEL, short)  # unfused validation takes the short batch
    BASE.validate(MODEL, listed)
    whole = fl.data.arrays(x[:16], y[:16], batch_size=8, shuffle=False, drop_remainder=False)
    BASE.validate(MODEL, whole, fuse=fuse)  # no short batch: nothing to refuse
    alone = fl.data.arrays(x[:5], y[:5], batch_size=8, shuffle=False, drop_remainder=False)
    state = BASE.validate(MODEL, alone, fuse=fuse).run(DATA)  # one batch: one shape
    assert (
        state.metrics["validation_loss"]
        == BASE.validate(MODEL, alone).run(DATA).metrics["validation_loss"]
    )


def test_a_fused_validation_of_resident_data_takes_its_short_batch():
    x, y = _ragged_val()
    host = fl.data.arrays(x, y, batch_size=8, shuffle=False, drop_remainder=False)
    resident = fl.data.arrays(x, y, batch_size=8, shuffle=False, drop_remainder=False, device=True)
    unfused = BASE.validate(MODEL, host).run(DATA, epochs=2)
    fused = BASE.validate(MODEL, resident, fuse=True).run(DATA, epochs=2, fuse=3)
    assert fused.history == unfused.history
    assert "validation_loss" in fused.history[1]


# ----------------------------------------------------------------- progress bar


def test_progress_bar_shows_epochs_and_metrics_without_extra_syncs(capsys):
    quiet = VALIDATED.run(DATA, epochs=2, fuse=3)
    capsys.readouterr()
    shown = VALIDATED.run(DATA, epochs=2, fuse=3, progress=True)
    err = capsys.readouterr().err
    # stderr is not a terminal here: one plain line per epoch, numbered from 1.
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 2, err
    assert lines[0].startswith("Epoch 1/2 - ") and lines[1].startswith("Epoch 2/2 - 5/5 - ")
    for line, epoch in zip(lines, (0, 1), strict=True):
        assert f"validation_accuracy: {shown.history[epoch]['validation_accuracy']:.7f}" in line
    assert shown.stats["host_syncs"] == quiet.stats["host_syncs"]
    assert shown.history == quiet.history


def test_a_second_validation_of_the_same_names_is_refused_and_its_fix_works():
    held_out = _batches(2, 5)
    loop = fl.trainer(MODEL, LOSS, "adam").metric("accuracy").validate(MODEL, VAL)
    with pytest.raises(ValueError, match=r"already adds validation_accuracy, validation_loss"):
        loop.validate(MODEL, held_out)
    # The fix the message names: an evaluator in an epoch_completed handler.
    scores = fl.evaluator(MODEL, LOSS)

    def holdout(state):
        loss = scores.run(held_out, state.params).metrics["loss"]
        return "continue", state.replace(metrics={**state.metrics, "holdout_loss": loss})

    both = loop.handle_event("epoch_completed", holdout)
    for fuse in (False, 3, "run"):
        state = both.run(DATA, epochs=2, fuse=fuse)
        expected = scores.run(held_out, state.params).metrics["loss"]
        assert state.history[1]["holdout_loss"] == expected
        assert state.history[1]["validation_loss"] != expected


@pytest.mark.parametrize("missing", ["none", "closed"])
def test_a_missing_or_closed_stdout_and_stderr_do_not_fail_the_run(monkeypatch, missing):
    # pythonw and some daemons have no sys.stderr/stdout: print writes nothing, and so do
    # the progress display and the log, rather than failing the training they report on.
    def gone() -> Any:
        if missing == "none":
            return None
        stream = io.StringIO()
        stream.close()
        return stream

    monkeypatch.setattr(sys, "stderr", gone())
    monkeypatch.setattr(sys, "stdout", gone())
    loop = fl.trainer(MODEL, LOSS, "adam", log=2).metric("accuracy")
    assert loop.run(DATA, epochs=2, progress=True, fuse=3).status == "completed"
    closed = io.StringIO()
    quiet = fl.trainer(MODEL, LOSS, "adam", log=2, log_stream=closed)
    closed.close()  # a stream the user passed and closed is their error: it raises
    with pytest.raises(ValueError, match="closed file"):
        quiet.run(DATA)


def test_an_error_in_the_validation_data_says_it_is_the_validation_datas():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32)
    bad = y.copy()
    bad[-1] = 5  # out of range for 3 classes, in the second validation batch
    val = [(x[:8], bad[:8]), (x[8:16], bad[8:])]
    loop = BASE.validate(MODEL, val)  # the file's trainer: its programs are built already
    with pytest.raises(ValueError, match="holds the label 5") as caught:
        loop.run(DATA)
    assert any("validate()'s data" in note for note in caught.value.__notes__)


def test_a_custom_loop_keeping_inner_params_is_told_what_validate_reads():
    """A hand-written step keeps `model.init(...)["params"]` under step_state["params"];
    the evaluator's "init_state" message is then about the training loop's params."""
    model = fl.models.mlp([3])
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    data = [(x, (x[:, 0] > 0).astype(np.int32))] * 2

    @jax.jit  # one program, not an eager op each
    def init_fn(batch, seed):
        inner = model.init(jax.random.PRNGKey(seed), batch[0])["params"]
        return {"params": inner, "y_pred": jnp.zeros((8, 3))}

    def step(batch, s):  # trains nothing: the predictions of the inner params
        return {**s, "y_pred": model.apply({"params": s["params"]}, batch[0])}

    loop = fl.loop(step, init_fn).metric("accuracy").validate(model, data)
    with pytest.raises(ValueError, match=r"variables\['params'\] alone") as info:
        loop.run(data, 0)
    notes = info.value.__notes__
    assert any("a custom loop must keep the model's whole variables" in n for n in notes)


def test_validation_at_the_runs_start_is_refused_naming_where_a_baseline_goes():
    # The first epoch starts the metrics afresh: a validation at "started" was computed and
    # lost, silently; "epoch_started" records the params each epoch starts from.
    with pytest.raises(ValueError, match=r"event='started'.*fl.evaluator.*'epoch_started'"):
        fl.trainer(MODEL, LOSS, "adam").validate(MODEL, DATA, event="started")
    state = fl.trainer(MODEL, LOSS, "adam").validate(MODEL, DATA, event="epoch_started").run(DATA)
    assert "validation_loss" in state.history[0]


@pytest.mark.parametrize("form", ["list", "arrays"])
def test_bad_validation_labels_are_refused_before_the_first_epoch_trains(form):
    """The validation data's labels were checked only when the first validation ran, after
    a whole epoch of training (whose State the error then lost)."""
    bad = [(x, y.copy()) for x, y in VAL]
    bad[-1][1][0] = 7  # 3 classes
    if form == "arrays":
        x, y = (np.concatenate([part[i] for part in bad]) for i in (0, 1))
        bad = fl.data.arrays(x, y, batch_size=len(VAL[0][1]), shuffle=False)
    stepped = []
    loop = BASE.validate(MODEL, bad).observe("iteration_completed", stepped.append)
    with pytest.raises(ValueError, match=r"holds the label 7, out of range") as caught:
        loop.run(DATA, epochs=2)
    assert stepped == []
    assert "validate()'s data" in "\n".join(caught.value.__notes__)


def test_float64_validation_data_is_named_in_its_warning():
    wide = [(x.astype(np.float64), y) for x, y in VAL]
    loop = fl.trainer(MODEL, LOSS, "adam").validate(MODEL, wide)
    with pytest.warns(UserWarning, match=r"^validate\(\)'s data: leaf x is float64") as caught:
        warnings.simplefilter("always")  # each warning seen, however often it repeats
        loop.run(DATA, epochs=3)
    assert not any(str(w.message).startswith("data:") for w in caught)
    # Once per run, as the training data's: it was said again at every epoch's validation.
    said = [w for w in caught if "float64" in str(w.message)]
    assert len(said) == 1
