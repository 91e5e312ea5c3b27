"""Bad arguments raise ValueError naming the argument and the accepted values, before
anything is pulled from the data or compiled."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import CountingGenerator, counter_init, counter_loop, make_batches, tiny_mlp, trainer

DATA = make_batches(3)


def check(error: pytest.ExceptionInfo, *words: str) -> None:
    message = str(error.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# --------------------------------------------------------------------------- names
def test_unknown_loss():
    with pytest.raises(ValueError) as info:
        fl.trainer(tiny_mlp(), "hinge", "sgd")
    check(
        info,
        "loss",
        "hinge",
        "mean_squared_error",
        "sparse_categorical_cross_entropy",
        "binary_cross_entropy",
        "categorical_cross_entropy",
        "mean_absolute_error",
    )


def test_unknown_optimizer():
    with pytest.raises(ValueError) as info:
        fl.trainer(tiny_mlp(), "mean_squared_error", "rmsprop")
    check(info, "optimizer", "rmsprop", "sgd", "adam", "adamw")


def test_optimizer_of_the_wrong_type():
    with pytest.raises(ValueError) as info:
        fl.trainer(tiny_mlp(), "mean_squared_error", 0.1)
    check(info, "optimizer", "sgd", "adam", "adamw")


def test_unknown_metric():
    with pytest.raises(ValueError) as info:
        trainer().metric("f1")
    check(
        info,
        "metric",
        "f1",
        "accuracy",
        "precision",
        "recall",
        "mean_absolute_error",
        "mean_squared_error",
    )


def test_unknown_accumulator():
    with pytest.raises(ValueError) as info:
        trainer().metric("accuracy", accumulate="median")
    check(info, "accumulate", "running_average", "running_sum")


def test_not_a_model():
    with pytest.raises(ValueError) as info:
        fl.trainer(42, "mean_squared_error", "sgd")
    check(info, "model")


@pytest.mark.parametrize(
    "kwargs,word", [({"log": -1}, "log"), ({"log": 1.5}, "log"), ({"seed": "x"}, "seed")]
)
def test_bad_trainer_options(kwargs, word):
    with pytest.raises(ValueError) as info:
        fl.trainer(tiny_mlp(), "mean_squared_error", "sgd", **kwargs)
    check(info, word)


# --------------------------------------------------------------------------- events and filters
@pytest.mark.parametrize("spec", ["sometimes", {"evry": 2}, {}, 3, ["every", 2]])
def test_bad_filter(spec):
    with pytest.raises(ValueError) as info:
        counter_loop().handle_event("iteration_completed", lambda s: None, filter=spec)
    check(info, "filter", "every", "before", "after", "once")


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_bad_filter_count(value):
    with pytest.raises(ValueError) as info:
        counter_loop().handle_event("iteration_completed", lambda s: None, filter={"every": value})
    check(info, "filter", "every", "positive")


def test_unknown_event():
    with pytest.raises(ValueError) as info:
        counter_loop().handle_event("iteration_done", lambda s: None)
    check(info, "event", "iteration_done", "iteration_completed", "epoch_halted", "completed")


def test_handler_must_be_callable():
    with pytest.raises(ValueError) as info:
        counter_loop().handle_event("epoch_completed", "print")
    check(info, "handler")


@pytest.mark.parametrize("handler", [lambda: None, lambda state, extra: None])
def test_a_handler_that_cannot_take_the_state_is_refused_when_attached(handler):
    # Not when its event first fires, which may be the end of a long run.
    with pytest.raises(ValueError, match=r"handler=<lambda>\(.*as handler\(state\).*def handler"):
        counter_loop().handle_event("completed", handler)
    with pytest.raises(ValueError, match=r"fn=<lambda>\(.*as fn\(state\).*def fn\(state\)"):
        counter_loop().observe("epoch_completed", handler)
    # What can take one State is accepted: defaults, *args, a bound method, a builtin.
    for fine in (lambda state, extra=1: None, lambda *states: None, [].append, print):
        counter_loop().handle_event("completed", fine)


def test_custom_loop_step_must_be_callable():
    with pytest.raises(ValueError, match="step_fn"):
        fl.loop(3)
    with pytest.raises(ValueError, match="init_fn"):
        fl.loop(lambda b, s: s, init_fn=3)


# --------------------------------------------------------------------------- run arguments
@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"epochs": 0}, ["epochs", "positive"]),
        ({"epochs": -1}, ["epochs", "positive"]),
        ({"epochs": 1.5}, ["epochs", "positive"]),
        ({"iterations": 0}, ["iterations", "positive"]),
        ({"max_in_flight": 0}, ["max_in_flight", "positive"]),
        ({"jit": "yes"}, ["jit", "True", "False"]),
    ],
)
def test_bad_run_arguments_fail_before_pulling_data(kwargs, words):
    source = CountingGenerator(DATA)
    with pytest.raises(ValueError) as info:
        counter_loop().run(source, counter_init(), **kwargs)
    check(info, *words)
    assert source.pulls == 0


@pytest.mark.parametrize("fuse", [0, -1, 1.5, "x", [4]])
def test_bad_fuse_values(fuse):
    source = CountingGenerator(DATA)
    with pytest.raises(ValueError) as info:
        counter_loop().run(source, counter_init(), fuse=fuse)
    check(info, "fuse", "True", "positive int")
    assert source.pulls == 0


@pytest.mark.parametrize("fuse", [True, 4])
def test_fuse_with_jit_false(fuse):
    with pytest.raises(ValueError) as info:
        counter_loop().run(DATA, counter_init(), fuse=fuse, jit=False)
    check(info, "fuse", "jit")


@pytest.mark.parametrize(
    "data",
    [[], lambda: iter([]), iter([]), (b for b in [])],
    ids=["list", "callable", "iterator", "generator"],
)
def test_empty_data(data):
    with pytest.raises(ValueError) as info:
        trainer().run(data)
    check(info, "data", "empty")


@pytest.mark.parametrize("data", [42, "batches", None])
def test_data_that_is_not_a_source(data):
    with pytest.raises(ValueError) as info:
        trainer().run(data)
    check(info, "data")


@pytest.mark.parametrize(
    "batch",
    [
        np.zeros((4, 3), np.float32),
        (np.zeros((4, 3), np.float32),),
        (np.zeros((4, 3), np.float32), np.zeros(4, np.int32), np.zeros(4, np.int32)),
    ],
    ids=["array", "1-tuple", "3-tuple"],
)
@pytest.mark.parametrize("fuse", [False, 4])
def test_a_batch_that_is_not_x_y(batch, fuse):
    with pytest.raises(ValueError) as info:
        trainer().run([batch] * 3, fuse=fuse)
    check(info, "(x, y)")


def test_errors_are_value_errors_and_fusion_error_is_one_too():
    assert issubclass(fl.FusionError, ValueError)


def test_metric_loss_says_where_the_loss_already_is():
    model = fl.models.mlp([3])
    trainer = fl.trainer(model, "sparse_categorical_cross_entropy", "sgd")
    with pytest.raises(ValueError, match=r"already tracks its loss as state.metrics\['loss'\]"):
        trainer.metric("loss")
    with pytest.raises(ValueError, match=r"fl.evaluator\(model, loss\)"):
        fl.evaluator(model).metric("loss")


def test_the_process_decorators_refuse_what_is_not_a_handler():
    # A forgotten decorator argument (`@fl.main_process_only(3)`) failed at the first event.
    for decorator in (fl.main_process_only, fl.all_processes):
        with pytest.raises(ValueError) as info:
            decorator(3)
        check(info, f"{decorator.__name__}(3)", "callable(state)")


def test_a_custom_loop_run_without_a_step_state_says_so():
    # The step's own TypeError ('NoneType' is not subscriptable) came with a note about
    # swapped arguments, not the missing init_state.
    with pytest.raises(TypeError) as info:
        fl.loop(lambda batch, s: {"n": s["n"] + 1}).run(DATA)
    assert any("step state is None: give it to run" in note for note in info.value.__notes__)


def test_a_custom_steps_signature_is_checked_when_the_loop_is_built():
    """Lightning's training_step(batch, batch_idx) failed at the first step, with a note
    about swapped arguments; an init_fn of one parameter got no note at all."""
    with pytest.raises(ValueError, match=r"step_fn=.*cannot be called as step_fn\(batch, ") as info:
        fl.loop(lambda batch, state, batch_idx: state)
    assert any("passes no batch index" in note for note in info.value.__notes__)
    with pytest.raises(ValueError, match=r"cannot be called as init_fn\(first_batch, init_state"):
        fl.loop(lambda batch, state: state, lambda seed: {"n": seed})
    fl.loop(lambda batch, state, index=0: state)  # a default: called with two, it runs
    fl.loop(lambda *args: args[1])
    with pytest.raises(ValueError, match=r"missing a required argument: 'lr'") as info:
        fl.loop(lambda batch, state, *, lr: state)  # not a batch index: no such note
    assert not getattr(info.value, "__notes__", [])


def test_only_the_errors_of_swapped_arguments_are_told_of_the_order():
    """Every TypeError or ValueError of a step got the note, a plain shape error too."""

    def shape_bug(batch, state):
        return {"w": state["w"] @ jnp.ones((5,))}  # (3,) @ (5,)

    def swapped(state, batch):
        return {"w": state["w"]}  # state is the batch tuple here

    def swapped_mean(state, batch):
        return {"w": jnp.mean(batch) * jnp.ones(3)}  # batch is the state dict here

    for step, told in ((shape_bug, False), (swapped, True), (swapped_mean, True)):
        with pytest.raises((TypeError, ValueError)) as info:
            fl.loop(step).run([(0.0, 0.0)], {"w": jnp.zeros(3)})
        notes = getattr(info.value, "__notes__", [])
        assert any("arguments are swapped" in note for note in notes) is told


def test_a_key_error_of_swapped_arguments_is_told_of_the_order():
    """flax's train_step(state, batch) habit on dict batches raises a KeyError (the state's
    key looked up in the batch), which got no note; a key missing from both does not."""
    batches = [{"image": np.ones((2, 3), np.float32), "label": np.zeros(2, np.float32)}]
    init = {"w": jnp.zeros(3)}

    def swapped(state, batch):
        return {"w": state["w"] + batch["image"].sum()}  # state is the batch dict here

    def misspelt(batch, state):
        return {"w": state["w"] + batch["images"].sum()}  # in neither argument

    config = {"lr": 0.1}

    def config_lookup(batch, state):  # the user's own dict misses a key the state has
        return {"w": state["w"] * config["w"]}

    for step, told in ((swapped, True), (misspelt, False), (config_lookup, False)):
        for data in (batches, [(b["image"], b["label"]) for b in batches]):
            if step is not config_lookup and isinstance(data[0], tuple):
                continue  # a tuple batch looked up by a key raises a TypeError
            for fuse in (False, 2):
                with pytest.raises(KeyError) as info:
                    fl.loop(step).run(data, init, fuse=fuse)
                notes = getattr(info.value, "__notes__", [])
                assert any("arguments are swapped" in note for note in notes) is told, notes


def test_a_loops_repr_is_a_short_summary():
    # A notebook cell ending in a builder echoed 2,600 characters of dataclass fields.
    loop = trainer().metric("accuracy").early_stop("loss").terminate_on_nan()
    text = repr(loop)
    assert text.startswith("Loop(trainer, loss='sparse_categorical_cross_entropy'")
    assert "'accuracy'" in text and "'early_stop'" in text and "0x" not in text
    assert len(text) < 300
    # A notebook cell run again attaches its handler again: the repr shows both.
    twice = loop.reduce_lr_on_plateau("loss").reduce_lr_on_plateau("loss")
    assert "'reduce_lr_on_plateau x2'" in repr(twice), repr(twice)
    assert "x2" not in text


# --------------------------------------------------------------------------- other frameworks
@pytest.mark.parametrize(
    ("keyword", "words"),
    [
        ("batch_size", ("fl.data.arrays(x, y, batch_size=32)",)),
        ("validation_data", ("loop.validate(model, val_data)",)),
        ("validation_split", ("shuffle=False, drop_remainder=False",)),
        ("callbacks", ("loop.early_stop(...)", "handle_event")),
        ("verbose", ("progress=True",)),
        ("steps_per_epoch", ("iterations=N",)),
        ("max_epochs", ("epochs=N",)),
        ("metrics", ('loop.metric("accuracy")',)),  # compile's, given to fit
        ("val_dataloaders", ("loop.validate(model, loader)",)),
        ("epoch", ("did you mean 'epochs'?",)),  # a misspelling of a keyword run() takes
        ("validation_freq", ('loop.validate(model, val_data, filter={"every": N})',)),
        ("workers", ("transfers the next chunk",)),
    ],
)
def test_a_keras_or_lightning_keyword_to_run_names_fuseloops_way(keyword, words):
    source = CountingGenerator(DATA)
    with pytest.raises(TypeError) as info:
        trainer().run(source, **{keyword: 3})
    check(info, f"Loop.run() got an unexpected keyword argument {keyword!r}", *words)
    assert source.pulls == 0  # refused before anything was read


@pytest.mark.parametrize("keyword", ["train", "deterministic", "rngs", "mc_dropout"])
def test_a_dropout_keyword_to_predict_names_the_trained_models_training_mode(keyword):
    """Monte Carlo dropout: Python's bare error said nothing of how to get samples."""
    model = tiny_mlp()
    variables = model.init(jax.random.PRNGKey(0), DATA[0][0])
    with pytest.raises(TypeError) as info:
        fl.predict(model, variables, DATA[0][0], **{keyword: True})
    check(info, f"predict() got an unexpected keyword argument {keyword!r}", "set_attributes(")


def test_a_keras_compile_keyword_to_a_factory_names_fuseloops_way():
    with pytest.raises(TypeError) as info:
        fl.trainer(tiny_mlp(), "mse", "adam", metrics=["accuracy"])
    check(info, "trainer() got an unexpected keyword argument 'metrics'", '.metric("accuracy")')
    with pytest.raises(TypeError) as info:
        fl.trainer(tiny_mlp(), "mse", "adam", learning_rate=0.1)
    check(info, "'learning_rate'", "optax.adam(learning_rate=1e-3)")
    with pytest.raises(TypeError) as info:  # Lightning's Trainer(max_epochs=...)
        fl.trainer(tiny_mlp(), "mse", "adam", max_epochs=3)
    check(info, "'max_epochs'", "loop.run(data, epochs=N)")
    with pytest.raises(TypeError) as info:  # an evaluator has no optimizer to name
        fl.evaluator(tiny_mlp(), "mse", learning_rate=0.1)
    check(info, "'learning_rate'", "an evaluator trains nothing")
    with pytest.raises(TypeError) as info:
        fl.evaluator(tiny_mlp(), "mse", ["accuracy"])
    check(info, "evaluator() takes at most 2 positional", '.metric("accuracy")')
    assert "keyword" not in str(info.value).split(": ", 1)[1]  # it takes no other option
    with pytest.raises(TypeError) as info:
        fl.trainer(tiny_mlp(), "mse", "adam", size=3)  # nothing close: what it takes
    check(info, "'size'", "log, log_stream, loss, model, optimizer, seed")
    with pytest.raises(TypeError) as info:
        fl.trainer(tiny_mlp(), "mse", "adam", loss_weights=[1.0, 0.5])
    check(info, "'loss_weights'", "a loss of your own")
    with pytest.raises(TypeError) as info:
        fl.trainer(tiny_mlp(), "sparse_categorical_cross_entropy", "adam", from_logits=True)
    check(info, "'from_logits'", "take logits", "end the model without one")


def test_keras_fit_keywords_given_to_arrays_name_fuseloops_way():
    """fl.data.arrays stands for fit(x, y, batch_size=...): its weights went unanswered."""
    x, y = DATA[0]
    for keyword in ("sample_weight", "class_weight"):
        with pytest.raises(TypeError) as info:
            fl.data.arrays(x, y, 2, **{keyword: np.ones(len(y))})
        check(info, f"arrays() got an unexpected keyword argument {keyword!r}", "go into y")
    with pytest.raises(TypeError, match=r"did you mean 'batch_size'\?"):
        fl.data.arrays(x, y, batchsize=2)
    assert len(fl.data.arrays(x, y, 2)) == len(y) // 2  # what it takes is left alone


@pytest.mark.parametrize(
    ("builder", "keyword", "words"),
    [
        ("early_stop", "restore_best_weights", "restore_best=True"),
        ("early_stop", "baseline", "'halt_loop'"),
        ("checkpoint", "monitor", "criteria='validation_loss'"),
        ("checkpoint", "save_best_only", "keep=1"),
        ("checkpoint", "save_weights_only", "fl.load_state(path).params"),
        ("reduce_lr_on_plateau", "epsilon", "min_delta="),
        ("csv_log", "append", "keeps the file's rows"),
        ("validate", "validation_freq", 'filter={"every": N}'),
        ("early_stop", "pateince", "did you mean 'patience'?"),
        ("tensorboard", "log_dir", "did you mean 'logdir'?"),
    ],
)
def test_a_keras_callback_keyword_to_a_builder_names_fuseloops_way(builder, keyword, words):
    """The builders a Keras user reaches for after run() raised Python's bare error."""
    with pytest.raises(TypeError) as info:
        getattr(trainer(), builder)(**{keyword: 1})
    check(info, f"Loop.{builder}() got an unexpected keyword argument {keyword!r}", words)


def test_the_keyword_check_leaves_what_run_takes_alone():
    state = trainer().run(DATA, epochs=1, iterations=2, fuse=2, progress=False)
    assert (state.status, state.iteration) == ("completed", 1)  # the second, counted from 0


def test_keras_positional_fit_and_compile_arguments_name_fuseloops_way():
    x, y = DATA[0]
    with pytest.raises(TypeError) as info:
        trainer().run(x, y, 4, 10)  # Keras's fit(x, y, batch_size, epochs)
    check(info, "5 were given", "run(fl.data.arrays(x, y, batch_size=32), epochs=10)")
    with pytest.raises(TypeError) as info:
        fl.trainer(tiny_mlp(), "mse", "adam", ["accuracy"])  # Keras's compile(..., metrics)
    check(info, "trainer() takes at most 3 positional arguments", '.metric("accuracy")')


def test_validate_given_only_the_data_names_the_model_it_also_takes():
    """A Keras user passes the validation data alone, as fit's validation_data."""
    with pytest.raises(TypeError) as info:
        trainer().validate(DATA)
    check(info, "Loop.validate() is missing 'data'", "loop.validate(model, val_data)")
    with pytest.raises(TypeError) as info:
        trainer().validate(data=DATA)
    check(info, "Loop.validate() is missing 'model'")
    assert "validation_loss" in trainer().validate(data=DATA, model=tiny_mlp()).run(DATA).metrics


def test_the_advice_for_other_frameworks_keywords_names_what_exists():
    from fuseloop._foreign_keywords import ARRAYS_ADVICE, FACTORY_ADVICE, RUN_ADVICE

    for advice in (*RUN_ADVICE.values(), *FACTORY_ADVICE.values(), *ARRAYS_ADVICE.values()):
        for name in re.findall(r"\bfl\.(\w+)", advice):
            assert hasattr(fl, name), advice
        for name in re.findall(r"\bloop\.(\w+)\(", advice):
            assert hasattr(fl.Loop, name), advice
        for name in re.findall(r"\bfl\.data\.(\w+)\(", advice):
            assert hasattr(fl.data, name), advice
