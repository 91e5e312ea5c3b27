"""The monitor, early stopping and LR on plateau."""

from __future__ import annotations

import math
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from fuseloop.handlers.monitor import (
    EarlyStopping,
    Monitor,
    ReduceLROnPlateau,
    find_learning_rates,
)

# ----------------------------------------------------------------- helpers


def _counter_loop() -> fl.Loop:
    """A custom loop that compiles in no time: it only counts its steps."""
    return fl.loop(lambda batch, s: {"n": s["n"] + 1})


def _scripted(loop: fl.Loop, values: list[float], name: str = "score") -> fl.Loop:
    """Sets metrics[name] = values[epoch] at each epoch end (before later handlers)."""

    def script(state: fl.State):
        metrics = {**state.metrics, name: values[state.epoch]}
        return "continue", state.replace(metrics=metrics)

    return loop.handle_event("epoch_completed", script)


def _run_scripted(values, **early_stop) -> fl.State:
    loop = _scripted(_counter_loop(), values).early_stop("score", **early_stop)
    return loop.run([(0, 0)] * 2, {"n": jnp.int32(0)}, epochs=len(values))


def _keras_stop(values, patience, mode="min", min_delta=0.0):
    """Reference: the epoch after which Keras' EarlyStopping stops (None: never), its
    `monitor_op(value - min_delta, best)` with min_delta negated in mode "min"."""
    best, wait = None, 0
    for epoch, value in enumerate(values):
        if not math.isfinite(value):
            return epoch
        better = best is None or (
            value + min_delta < best if mode == "min" else value - min_delta > best
        )
        if better:
            best, wait = value, 0
        else:
            wait += 1
            if wait >= patience:
                return epoch
    return None


def _batches(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))
        for _ in range(n)
    ]


def _labelled(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32))
        for _ in range(n)
    ]


def _flat(y_true, y_pred):
    return jnp.float32(1.0)  # never improves: a plateau from the second epoch on


# ----------------------------------------------------------------- option validation


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"mode": "lowest"}, "mode"),
        ({"patience": -1}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"min_delta": -0.1}, "min_delta"),
        ({"min_delta": float("nan")}, "min_delta"),
    ],
)
def test_monitor_options_are_validated(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Monitor("loss", **kwargs)
    with pytest.raises(ValueError, match=word):
        _counter_loop().early_stop("loss", **kwargs)


def test_monitor_name_is_validated():
    with pytest.raises(ValueError, match="monitor"):
        Monitor("")


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"factor": 1.0}, "factor"),
        ({"factor": 0.0}, "factor"),
        ({"factor": 2}, "factor"),
        ({"min_lr": -1.0}, "min_lr"),
        ({"cooldown": -1}, "cooldown"),
        ({"mode": "up"}, "mode"),
    ],
)
def test_reduce_lr_options_are_validated(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ReduceLROnPlateau("loss", **kwargs)


def test_improvement_rules():
    low = Monitor("m", mode="min", min_delta=0.1)
    assert low.improves(1.0, None)
    assert low.improves(0.85, 1.0) and not low.improves(0.95, 1.0)
    high = Monitor("m", mode="max")
    assert high.improves(2.0, 1.0) and not high.improves(1.0, 1.0)
    assert not low.improves(float("nan"), None) and not high.improves(float("inf"), 1.0)
    # Keras 3 rounds `value + min_delta`: 3.9 + 0.5 == 4.4 is no improvement, though
    # 4.4 - 0.5 rounds to 3.9000000000000004, which 3.9 beats (so did this rule once).
    assert not Monitor("m", min_delta=0.5).improves(3.9, 4.4)
    assert Monitor("m", mode="max", min_delta=0.5).improves(0.8, 0.3)  # 0.8 > 0.3 + 0.5


# ----------------------------------------------------------------- early stopping


@pytest.mark.parametrize(
    "values, patience, mode, min_delta",
    [
        ([5.0, 4.0, 4.5, 4.2, 3.0, 2.0], 2, "min", 0.0),  # stops after epoch 3
        ([5.0, 4.0, 4.5, 3.9, 4.2, 4.1, 4.0], 2, "min", 0.0),
        ([1.0, 0.99, 0.98, 0.97, 0.96], 2, "min", 0.05),  # improvements below min_delta
        ([1.0, 2.0, 3.0, 2.5, 2.9, 3.5], 1, "max", 0.0),
        ([3.0, 2.0, 1.0, 0.5], 3, "min", 0.0),  # never stops
        ([3.0, 3.0, 3.0], 0, "min", 0.0),  # patience 0: the first plateau stops
        # By exactly min_delta: 3.9 + 0.5 == 4.4 is no improvement (4.4 - 0.5 would round
        # to 3.9000000000000004, which 3.9 beats), nor in mode "max" the other way round.
        ([5.0, 4.4, 3.9, 3.8, 3.7], 1, "min", 0.5),
        ([-1.0, 0.3, 0.8, 0.7, 0.6], 1, "max", 0.5),
    ],
)
def test_early_stop_patience_on_a_scripted_metric(values, patience, mode, min_delta):
    state = _run_scripted(values, patience=patience, mode=mode, min_delta=min_delta)
    expected = _keras_stop(values, patience, mode, min_delta)
    if expected is None:
        assert state.status == "completed" and len(state.history) == len(values)
    else:
        assert state.status == "halted"
        assert max(state.history) == expected
        assert state.handler_metadata["early_stop:score"]["stopped_epoch"] == expected


def test_early_stop_example_from_the_docs():
    # Patience 2: epochs 2 and 3 do not beat epoch 1's 4.0, so the loop stops after epoch 3.
    state = _run_scripted([5.0, 4.0, 4.5, 4.2, 3.0, 2.0], patience=2)
    assert sorted(state.history) == [0, 1, 2, 3]
    record = state.handler_metadata["early_stop:score"]
    assert record["best"] == 4.0 and record["best_epoch"] == 1 and record["wait"] == 2


def test_non_finite_monitored_value_stops_at_once_and_says_why():
    with pytest.warns(RuntimeWarning, match="score is nan at epoch 2, not a finite.*diverged"):
        state = _run_scripted([3.0, 2.0, float("nan"), 1.0], patience=10)
    assert state.status == "halted" and max(state.history) == 2


def test_missing_monitor_names_the_available_metrics():
    loop = _scripted(_counter_loop(), [1.0, 1.0]).early_stop("validation_loss")
    with pytest.raises(ValueError, match=r"validation_loss.*score.*validate"):
        loop.run([(0, 0)], {"n": jnp.int32(0)}, epochs=2)


def test_a_monitor_naming_the_loss_by_its_name_is_told_it_is_kept_as_loss():
    """`early_stop("mse")` under loss="mse" was told to add the metric with Loop.metric(...)
    and nothing of the loss, which Keras and fuseloop keep as "loss" whichever it is."""
    loop = _scripted(_counter_loop(), [1.0, 1.0], name="loss").early_stop("mse")
    told = r"where 'mse' is the trainer's loss, it is kept as 'loss'.*monitor 'loss'; to track"
    with pytest.raises(ValueError, match=told + r" it as well, attach Loop.metric\('mse'\)"):
        loop.run([(0, 0)], {"n": jnp.int32(0)}, epochs=2)
    # The monitor does not know the loss: under loss="mae" monitoring "mse" must not read
    # as "monitor 'loss'" alone; a validation metric is attached before validate.
    validated = fl.State().replace(metrics={"loss": 1.0, "validation_loss": 1.0})
    with pytest.raises(ValueError, match=r"attach Loop.metric\('mse'\) before Loop.validate"):
        Monitor("val_mse").value(validated)
    with pytest.raises(ValueError, match=r"'validation_loss'; for another loss, track it"):
        Monitor("val_binary_crossentropy").value(validated)  # no metric of that name
    with pytest.raises(ValueError, match=r"Add it with Loop.metric"):  # not a loss's name
        Monitor("accuracy").value(validated)


def test_a_misspelt_monitor_is_told_the_metric_it_resembles():
    """A typo of a metric the epoch has ("validation_los") was told to attach
    Loop.metric('los'), which is no metric; Keras's val_ before validate was not named."""
    typo = _scripted(_counter_loop(), [1.0, 1.0], name="validation_loss")
    with pytest.raises(ValueError, match=r"did you mean 'validation_loss'\? Monitor"):
        typo.early_stop("validation_los").run([(0, 0)], {"n": jnp.int32(0)}, epochs=2)
    keras = _scripted(_counter_loop(), [1.0, 1.0]).early_stop("val_loss")
    with pytest.raises(ValueError, match=r"\(fuseloop names a validation metric validation_"):
        keras.run([(0, 0)], {"n": jnp.int32(0)}, epochs=2)
    # Names are compared within their kind: another metric's validation is no typo of it,
    # nor a training metric of a validation name.
    epoch = fl.State().replace(metrics={"mse": 1.0, "mae": 1.0, "validation_mse": 1.0})
    with pytest.raises(ValueError, match=r"not 'mae'.*attach Loop.metric\('mae'\) before"):
        Monitor("validation_mae").value(epoch)
    misspelt = fl.State().replace(metrics={"loss": 1.0, "validation_loss": 1.0})
    with pytest.raises(ValueError, match=r"did you mean 'validation_loss'"):
        Monitor("validaton_loss").value(misspelt)
    trained = fl.State().replace(metrics={"loss": 1.0, "accuracy": 0.5})
    with pytest.raises(ValueError, match=r"\(fuseloop names .*\)\. Add it") as caught:
        Monitor("val_accuracy").value(trained)
    assert "did you mean" not in str(caught.value)


def test_two_monitors_on_one_metric_keep_separate_records():
    loop = (
        _scripted(_counter_loop(), [3.0, 4.0, 5.0, 6.0])
        .early_stop("score", patience=5)
        .early_stop("score", patience=2)
    )
    state = loop.run([(0, 0)], {"n": jnp.int32(0)}, epochs=4)
    assert set(state.handler_metadata) == {"early_stop:score", "early_stop:score#2"}
    assert max(state.history) == 2 and state.status == "halted"


def test_early_stop_resumes_its_wait_count_from_the_state():
    values = [5.0, 4.0, 4.5, 4.2, 3.0, 2.0]
    loop = _scripted(_counter_loop(), values).early_stop("score", patience=2)
    first = loop.run([(0, 0)], {"n": jnp.int32(0)}, epochs=3)
    assert first.status == "completed" and first.handler_metadata["early_stop:score"]["wait"] == 1
    resumed = loop.run([(0, 0)], first, epochs=len(values))
    assert resumed.status == "halted" and max(resumed.history) == 3


# ----------------------------------------------------------------- LR on plateau


def test_find_learning_rates_in_a_chain():
    tx = optax.chain(optax.clip(1.0), optax.inject_hyperparams(optax.sgd)(learning_rate=0.5))
    rates = find_learning_rates(tx.init({"w": jnp.zeros(3)}))
    assert [float(r) for r in rates] == [0.5]
    assert find_learning_rates(optax.adam(1e-3).init({"w": jnp.zeros(3)})) == []


def test_fixed_learning_rate_is_refused_when_attached():
    loop = fl.trainer(fl.models.mlp([4, 1]), "mean_squared_error", optax.adam(1e-3))
    with pytest.raises(ValueError, match="inject_hyperparams"):
        loop.reduce_lr_on_plateau("loss")
    # A rate given as an int is held as int32: halved, 1 became 0 and training stopped.
    whole = optax.inject_hyperparams(optax.sgd)(learning_rate=1)
    loop = fl.trainer(fl.models.mlp([4, 1]), "mean_squared_error", whole)
    with pytest.raises(ValueError, match=r"as int32 .*learning_rate=1\.0\)$"):
        loop.reduce_lr_on_plateau("loss")
    half = optax.inject_hyperparams(optax.sgd)(learning_rate=jnp.bfloat16(0.5))
    fl.trainer(fl.models.mlp([4, 1]), "mean_squared_error", half).reduce_lr_on_plateau("loss")
    with pytest.raises(ValueError, match="trainer"):
        _counter_loop().reduce_lr_on_plateau("loss")


def _lr(state: fl.State) -> float:
    return float(find_learning_rates(state.step_state["opt_state"])[0])


def _set_lr(state: fl.State, value: np.float32) -> fl.State:
    opt_state = state.step_state["opt_state"]
    hyper = {**opt_state.hyperparams, "learning_rate": jnp.asarray(value, jnp.float32)}
    step_state = {**state.step_state, "opt_state": opt_state._replace(hyperparams=hyper)}
    return state.replace(step_state=step_state)


@pytest.fixture(scope="module")
def plateau_runs():
    data = _batches(4, 0)
    plain = fl.trainer(fl.models.mlp([4, 1]), "mean_squared_error", "sgd").metric(_flat, "flat")
    reducing = plain.reduce_lr_on_plateau("flat", factor=0.5, patience=1)
    return data, plain, reducing


@pytest.mark.parametrize("fuse", [False, 3])
def test_reduce_lr_on_plateau_is_effective_from_the_next_epoch(plateau_runs, fuse):
    data, plain, reducing = plateau_runs
    state = reducing.run(data, epochs=3, fuse=fuse)
    # "flat" never improves: epoch 0 sets the best, epochs 1 and 2 each halve the rate.
    lr0 = np.float32(0.01)
    assert _lr(state) == float(lr0 * np.float32(0.25))
    assert state.handler_metadata["reduce_lr_on_plateau:flat"]["reductions"] == 2
    # The same trajectory by hand: train, change the rate in the optimizer state, resume.
    manual = _set_lr(plain.run(data, epochs=2, fuse=fuse), lr0 * np.float32(0.5))
    manual = plain.run(data, manual, epochs=3, fuse=fuse)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(manual.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_manual_reference_differs_without_the_change(plateau_runs):
    # Guards the test above: changing the rate really changes the params.
    data, plain, reducing = plateau_runs
    reduced = reducing.run(data, epochs=3)
    unchanged = plain.run(data, epochs=3)
    leaves = zip(jax.tree.leaves(reduced.params), jax.tree.leaves(unchanged.params), strict=True)
    assert any(not np.array_equal(a, b) for a, b in leaves)


def test_reduce_lr_respects_min_lr_and_cooldown(plateau_runs):
    data, plain, _ = plateau_runs
    floor = plain.reduce_lr_on_plateau("flat", factor=0.1, patience=1, min_lr=0.004)
    state = floor.run(data[:1], epochs=4)
    assert _lr(state) == pytest.approx(0.004)
    # Once at the floor (float32 0.004 is above the Python 0.004) nothing more is counted,
    # and the wait count goes on growing, as Keras's does: epochs 2 and 3 add one each.
    record = state.handler_metadata["reduce_lr_on_plateau:flat"]
    assert (record["reductions"], record["wait"]) == (1, 2)
    cooling = plain.reduce_lr_on_plateau("flat", factor=0.5, patience=1, cooldown=2)
    state = cooling.run(data[:1], epochs=5)
    # Reduced after epoch 1, then two cooldown epochs, then reduced again after epoch 4.
    assert state.handler_metadata["reduce_lr_on_plateau:flat"]["reductions"] == 2


def test_reduce_lr_works_with_a_chained_injected_optimizer():
    tx = optax.chain(optax.clip(1.0), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    loop = (
        fl.trainer(fl.models.mlp([4, 1]), "mean_squared_error", tx)
        .metric(_flat, "flat")
        .reduce_lr_on_plateau("flat", factor=0.5, patience=1)
    )
    state = loop.run(_batches(1, 0), epochs=2)
    assert _lr(state) == float(np.float32(0.1) * np.float32(0.5))
    assert type(state.step_state["opt_state"]) is tuple  # the chain's structure is kept


def test_reduce_lr_handler_unit():
    handler = ReduceLROnPlateau("m", factor=0.5, patience=2, key="k")
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
    state = fl.State(step_state={"opt_state": tx.init(jnp.zeros(2))}, metrics={"m": 1.0})
    for _ in range(3):  # best, wait 1, wait 2 -> reduce
        _, state = handler(state)
    assert _lr(state) == 0.5 and state.handler_metadata["k"]["wait"] == 0
    assert isinstance(EarlyStopping("m")(state)[1], fl.State)


def test_a_validation_metric_attached_after_validate_is_named_as_the_cause():
    model = fl.models.mlp([4, 1])
    loop = (
        fl.trainer(model, "mean_squared_error", "sgd")
        .validate(model, _batches(2, 1))
        .metric("mae")  # after validate: validation computes only the loss
        .early_stop("validation_mae")
    )
    with pytest.raises(ValueError, match=r"attach Loop.metric\('mae'\) before it"):
        loop.run(_batches(3, 0))
    # Keras's "acc" keeps its key: the validation metric is validation_acc (the message told
    # the user to attach a metric already attached).
    acc = fl.trainer(fl.models.mlp([4, 3]), "sparse_categorical_cross_entropy", "sgd")
    acc = acc.metric("acc").validate(fl.models.mlp([4, 3]), _labelled(2, 1))
    acc = acc.handle_event("epoch_completed", EarlyStopping("validation_accuracy", mode="max"))
    with pytest.raises(ValueError, match=r"keeps the key it was given; monitor 'validation_acc'"):
        acc.run(_labelled(3, 0))


@pytest.mark.parametrize("handler", ["early_stop", "reduce_lr_on_plateau", "checkpoint"])
def test_a_monitored_name_validation_never_gives_is_refused_before_training(handler):
    """Keras's "val_loss", and a validation metric that validate's filter leaves out of
    some epochs, failed only at the end of an epoch, after training."""
    model = fl.models.mlp([4, 1])
    base = fl.trainer(model, "mean_squared_error", "sgd")
    attach = ATTACH[handler]
    said = (
        r"checkpoint\(path, criteria='val_loss'\).*criteria='validation_loss'"
        if handler == "checkpoint"
        else rf"{handler}\('val_loss'\).*monitor 'validation_loss'"
    )
    with pytest.raises(ValueError, match=said):
        attach(base.validate(model, _batches(2, 1)), "val_loss")
    # Keras's other spelling of the metric (a handler could add a metric so named: it is
    # told when the epoch lacks it): the key is the one the metric was added with.
    mae = base.metric("mae").validate(model, _batches(2, 1))
    for keras in ("val_mean_absolute_error", "validation_mean_absolute_error"):
        with pytest.raises(
            ValueError, match=r"keeps the key it was given; monitor 'validation_mae'"
        ):
            attach(mae, keras).run(_batches(3, 0))
    sparse = base.validate(model, _batches(2, 1), filter={"every": 2})
    fix = "handle_event" if handler != "checkpoint" else r"loop.checkpoint\(\.\.\., filter="
    with pytest.raises(ValueError, match=rf"validate's filter leaves some epochs .*{fix}"):
        attach(sparse, "validation_loss")
    assert attach(sparse, "loss").run(_batches(3, 0), epochs=2).status == "completed"
    if handler == "checkpoint":  # its own filter, validate's: it reads only validated epochs
        saver = sparse.checkpoint(
            tempfile.mkdtemp(), filter={"every": 2}, criteria="validation_loss"
        )
        assert saver.run(_batches(3, 0), epochs=3).status == "completed"
    by_hand = base.validate(model, _batches(2, 1)).handle_event(
        "epoch_completed", EarlyStopping("val_loss")
    )
    with pytest.raises(ValueError, match=r"Keras's val_<name>\); monitor 'validation_loss'"):
        by_hand.run(_batches(3, 0))  # a handler the Loop did not build: named when it runs
    every = EarlyStopping("validation_loss", patience=1)
    state = sparse.handle_event("epoch_completed", every, filter={"every": 2})
    assert state.run(_batches(3, 0), epochs=3).status in ("completed", "halted")


# ----------------------------------------------------------------- mode from the name


def test_mode_auto_reads_the_direction_from_the_words_of_the_name():
    """ "auto" once matched letters: "cauchy_loss" read as an AUC (max) and an R2 as a loss
    (min), so restore_best kept the worst epoch. It reads words, and refuses a name that
    says neither way (as Keras 3 does) instead of taking it for a loss."""
    rising, falling = [0.4, 0.5, 0.6, 0.7, 0.8], [0.8, 0.7, 0.6, 0.5, 0.4]
    for name, values in [
        ("validation_accuracy", rising),
        ("validation_r2", rising),
        ("validation_R2Score", rising),
        ("validation_cauchy_loss", falling),
        ("accumulated_error", falling),
        ("validation_dice_loss", falling),  # both kinds of word: the last decides
        ("validation_mean_io_u", rising),  # Keras's name for its MeanIoU
        ("MeanIoU", rising),
    ]:
        loop = _scripted(_counter_loop(), values, name=name)
        loop = loop.early_stop(name, patience=1, mode="auto")
        state = loop.run([(0, 0)] * 2, {"n": jnp.int32(0)}, epochs=len(values))
        assert state.status == "completed", name  # every epoch improves
        assert state.handler_metadata[f"early_stop:{name}"]["best"] == values[-1]
    with pytest.raises(ValueError, match=r"early_stop\(monitor='score', mode='auto'\).*mode='max'"):
        _run_scripted(rising, patience=1, mode="auto")
    # scikit-learn's negated scores rise ("neg_mean_squared_error"), a negative class's
    # recall rises too, and a negative log-likelihood falls: a name with such a word is
    # read neither way, not by the word it may negate.
    for name, word in (
        ("validation_neg_mse", "neg"),
        ("negative_class_recall", "negative"),
        ("minus_loss", "minus"),
    ):
        with pytest.raises(ValueError, match=rf"'{word}' may negate the rest .*mode='max'"):
            _counter_loop().early_stop(name, patience=1, mode="auto")


ATTACH = {
    "early_stop": lambda loop, name, **mode: loop.early_stop(name, **mode),
    "reduce_lr_on_plateau": lambda loop, name, **mode: loop.reduce_lr_on_plateau(name, **mode),
    "checkpoint": lambda loop, name, **mode: loop.checkpoint(
        tempfile.mkdtemp(), criteria=name, **mode
    ),
}


@pytest.mark.parametrize("handler", list(ATTACH))
def test_min_on_a_rising_metric_warns_with_the_fix(handler):
    """Keras's default mode reads "max" from an accuracy's name; fuseloop's default is
    "min", which on an accuracy would stop while it still rises and keep the worst epoch."""
    attach = ATTACH[handler]
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "adam")
    for name in ("validation_accuracy", "acc", "recall", "validation_r2"):
        with pytest.warns(UserWarning, match=rf"{handler}: .*'{name}' rises .*mode='max'"):
            attach(loop, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach(loop, "validation_loss")
        attach(loop, "validation_cauchy_loss")  # no "auc" in it
        attach(loop, "accumulated_error")  # nor an "acc"
        attach(loop, "validation_accuracy", mode="max")
        attach(loop, "validation_accuracy", mode="auto")
    with pytest.raises(ValueError, match="accepted values: min, max, auto"):
        attach(loop, "loss", mode="lowest")


@pytest.mark.parametrize("handler", ["early_stop", "reduce_lr_on_plateau", "checkpoint"])
def test_a_training_metric_monitored_by_its_other_name_is_told_its_key(handler):
    """Told at the first epoch's end (a handler could add a metric so named)."""
    model = fl.models.mlp([4, 1])
    mae = fl.trainer(model, "mean_squared_error", "sgd").metric("mae")
    with pytest.raises(ValueError, match=r"keeps the key it was given; monitor 'mae'"):
        ATTACH[handler](mae, "mean_absolute_error").run(_batches(3, 0))
