"""The event system of an unfused run: the exact stream, counts, the handler return
protocol, registration order and `state.replace`."""

from __future__ import annotations

import functools

import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import (
    EVENTS,
    assert_tree_equal,
    counter_init,
    counter_loop,
    make_batches,
    record_all,
    tiny_mlp,
    trainer,
)


def expected_stream(epochs: int, n: int) -> list[tuple]:
    """The plain loop's event stream: (event, epoch) for epoch/run events and
    (event, epoch, iteration) for iteration events."""
    out: list[tuple] = [("started", 0)]
    for epoch in range(epochs):
        out.append(("epoch_started", epoch))
        for i in range(n):
            out += [("iteration_started", epoch, i), ("iteration_completed", epoch, i)]
        out.append(("epoch_completed", epoch))
    out.append(("completed", epochs - 1))
    return out


def as_stream(log: list[tuple]) -> list[tuple]:
    return [item[:3] if item[0].startswith("iteration") else item[:2] for item in log]


def expected_counts(epochs: int, n: int, **changes) -> dict:
    counts = {
        "started": 1,
        "epoch_started": epochs,
        "iteration_started": {"total": epochs * n, "epoch": n},
        "iteration_completed": {"total": epochs * n, "epoch": n},
        "epoch_completed": epochs,
        "epoch_halted": 0,
        "halted": 0,
        "completed": 1,
    }
    counts.update(changes)
    return counts


def test_event_stream_of_a_plain_trainer_run():
    log: list = []
    loop = record_all(trainer().metric("accuracy"), log)
    state = loop.run(make_batches(3), epochs=2)
    assert as_stream(log) == expected_stream(2, 3)
    assert state.event_counts == expected_counts(2, 3)
    assert state.status == "completed"
    assert sorted(state.history) == [0, 1]
    assert sorted(state.times) == [0, 1]
    assert all(t >= 0 for t in state.times.values())


def test_event_stream_of_a_custom_loop_and_counts_seen_by_handlers():
    seen: list = []

    def on(event):
        def handler(state):
            counts = state.event_counts[event]
            seen.append((event, counts["total"] if isinstance(counts, dict) else counts))

        return handler

    loop = counter_loop()
    for event in EVENTS:
        loop = loop.handle_event(event, on(event))
    state = loop.run(make_batches(4), counter_init(), epochs=3)
    # Each handler sees its own event already counted (counts start at 1).
    for event in EVENTS:
        totals = [c for e, c in seen if e == event]
        assert totals == list(range(1, len(totals) + 1)), event
    assert state.event_counts == expected_counts(3, 4)
    assert int(state.step_state["n"]) == 12


def test_iteration_handlers_see_live_state_and_per_epoch_counts():
    seen: list = []

    def handler(state):
        seen.append(
            (
                state.epoch,
                state.iteration,
                state.event_counts["iteration_completed"],
                state.step_state is not None,
                state.max_epoch,
                state.max_iteration,
            )
        )

    state = trainer().handle_event("iteration_completed", handler).run(make_batches(3), epochs=2)
    assert seen == [
        (e, i, {"total": 3 * e + i + 1, "epoch": i + 1}, True, 2, None)
        for e in range(2)
        for i in range(3)
    ]
    assert state.max_epoch == 2


def test_epoch_handlers_see_complete_state_with_params():
    seen: list = []

    def handler(state):
        seen.append(
            (
                state.epoch,
                set(state.metrics),
                state.params is not None,
                int(state.step_state["step"]),
            )
        )

    trainer().metric("accuracy").handle_event("epoch_completed", handler).run(
        make_batches(3), epochs=2
    )
    tracked = {"loss", "learning_rate", "accuracy"}  # a named optimizer's rate is tracked
    assert seen == [(0, tracked, True, 3), (1, tracked, True, 6)]


def test_every_event_but_fused_iterations_sees_the_step_state():
    """Epoch- and run-level handlers see a complete State, including `started` (the
    initial step state) and `completed`."""
    seen: dict = {}

    def look(event):
        def handler(state):
            seen.setdefault(event, set()).add(
                None if state.step_state is None else int(state.step_state["step"])
            )

        return handler

    loop = trainer()
    for event in EVENTS:
        loop = loop.handle_event(event, look(event))
    loop.run(make_batches(2), epochs=1)
    assert seen["started"] == {0}
    assert seen["epoch_started"] == {0}
    assert seen["iteration_started"] == {0, 1}
    assert seen["iteration_completed"] == {1, 2}
    assert seen["epoch_completed"] == {2}
    assert seen["completed"] == {2}


@pytest.mark.parametrize("returned", [None, "continue", ("continue", None)])
def test_continue_returns_change_nothing(returned):
    data = make_batches(4)
    loop = counter_loop()
    reference = loop.run(data, counter_init(), epochs=2)

    def handler(state):
        return ("continue", state) if isinstance(returned, tuple) else returned

    state = (
        loop.handle_event("iteration_completed", handler)
        .handle_event("epoch_completed", handler)
        .run(data, counter_init(), epochs=2)
    )
    assert_tree_equal(state.step_state, reference.step_state)
    assert state.event_counts == reference.event_counts
    assert state.status == "completed"


def test_invalid_status_is_a_value_error_naming_the_accepted_statuses():
    loop = counter_loop().handle_event("epoch_completed", lambda s: "stop")
    with pytest.raises(ValueError, match="halt_epoch") as info:
        loop.run(make_batches(2), counter_init())
    assert "continue" in str(info.value) and "halt_loop" in str(info.value)


def test_second_element_must_be_a_state():
    loop = counter_loop().handle_event("epoch_completed", lambda s: ("continue", {"epoch": 1}))
    with pytest.raises(ValueError, match="State"):
        loop.run(make_batches(2), counter_init())


def test_a_pair_in_the_wrong_order_is_named_by_type_not_by_its_repr():
    """`(state, "continue")` is the likeliest slip; the message named the State by its repr,
    every array of its step state included (42 KB for a small MLP)."""
    loop = counter_loop().handle_event("epoch_completed", lambda s: (s, "continue"))
    with pytest.raises(ValueError, match="first item is State, not a status") as info:
        loop.run(make_batches(2), counter_init())
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("moved", [{"epoch": 5}, {"iteration": 7}, {"max_epoch": 9}])
def test_a_returned_state_may_not_move_the_loops_counters(moved):
    """The loop ignored a moved epoch but wrote the history under it ({0, 5, 1, 2})."""
    loop = counter_loop().handle_event(
        "epoch_completed", lambda s: ("continue", s.replace(**moved))
    )
    with pytest.raises(ValueError, match=f"{next(iter(moved))} is .*counters are its own"):
        loop.run(make_batches(2), counter_init(), epochs=3)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"step_state": None}, r"step_state is None: the loop trains on"),
        ({"status": "halted"}, r"status is 'halted', not 'running': .* return 'halt_loop'"),
        ({"history": {"a": {"loss": 1.0}}}, r"history has the key 'a'"),
        ({"metrics": {"count": "x"}}, r"metrics\['count'\] is 'x': metrics are numbers"),
        ({"history": {0: {"count": None}}}, r"history\[0\]\['count'\] is None"),
    ],
)
def test_a_returned_state_the_loop_would_drop_or_misread_is_refused(changes, named):
    # Each was ignored (step_state, status) or kept to fail later in save_state or a plot.
    loop = counter_loop().handle_event(
        "epoch_completed", lambda s: ("continue", s.replace(**changes))
    )
    with pytest.raises(ValueError, match=named):
        loop.run(make_batches(2), counter_init(), epochs=2)


def test_a_handler_may_add_a_number_to_the_metrics_and_history():
    def add(s):
        history = {**s.history, s.epoch: {**s.history.get(s.epoch, {}), "extra": 2}}
        return "continue", s.replace(metrics={**s.metrics, "extra": np.float32(1)}, history=history)

    state = (
        counter_loop()
        .handle_event("epoch_completed", add)
        .run(make_batches(2), counter_init(), epochs=2)
    )
    assert state.metrics["extra"] == 1


def _written(s: fl.State) -> None:  # Keras's habit: logs["my"] = value, returning None
    s.metrics["my"] = 0.5 + s.epoch


def _logged(s: fl.State) -> None:
    s.history[s.epoch]["mine"] = 2.5 + s.epoch


def _returned(s: fl.State) -> tuple[str, fl.State]:
    metrics = {**s.metrics, "my": 0.5 + s.epoch, "mine": 2.5 + s.epoch}
    return "continue", s.replace(metrics=metrics)


@pytest.mark.parametrize("fuse", [False, 2])
def test_metrics_and_history_written_in_place_at_epoch_end_are_taken_as_returned(fuse):
    # A write into state.metrics reached the metrics and the CSV but not the history; one
    # into state.history[epoch] the history alone, and a later handler returning a State
    # erased it.
    base = counter_loop()
    later = lambda s: ("continue", s)  # noqa: E731 - returns a State: history is recorded anew
    loop = base.handle_event("epoch_completed", _written).handle_event("epoch_completed", _logged)
    ran = loop.handle_event("epoch_completed", later).run(
        make_batches(2), counter_init(), epochs=2, fuse=fuse
    )
    same = base.handle_event("epoch_completed", _returned).run(
        make_batches(2), counter_init(), epochs=2, fuse=fuse
    )
    assert ran.history == same.history and ran.metrics == same.metrics
    assert [ran.history[e]["mine"] for e in (0, 1)] == [2.5, 3.5]


def test_other_return_types_are_rejected():
    loop = counter_loop().handle_event("epoch_completed", lambda s: 3)
    with pytest.raises(ValueError, match="returned int"):
        loop.run(make_batches(2), counter_init())


def test_handlers_run_in_registration_order():
    order: list = []
    loop = counter_loop()
    for name in "abc":
        loop = loop.handle_event("epoch_completed", lambda s, name=name: order.append(name))
    loop.run(make_batches(2), counter_init(), epochs=2)
    assert order == list("abcabc")


@pytest.mark.parametrize("event", ["iteration_completed", "epoch_completed", "started"])
def test_first_halt_stops_the_remaining_handlers(event):
    called: list = []
    loop = (
        counter_loop()
        .handle_event(event, lambda s: called.append("a"))
        .handle_event(event, lambda s: (called.append("b"), "halt_loop")[1])
        .handle_event(event, lambda s: called.append("c"))
    )
    state = loop.run(make_batches(3), counter_init(), epochs=2)
    assert called == ["a", "b"]
    assert state.status == "halted"


def test_state_replace_from_handlers_is_carried_along():
    def mark_epoch(state):
        meta = dict(state.handler_metadata)
        meta.setdefault("epochs", []).append(state.epoch)
        return "continue", state.replace(handler_metadata=meta)

    def add_metric(state):
        return "continue", state.replace(metrics={**state.metrics, "extra": 2.5})

    loop = (
        counter_loop()
        .metric("total", accumulate="running_sum")
        .handle_event("epoch_started", mark_epoch)
        .handle_event("epoch_completed", add_metric)
    )
    state = loop.run(make_batches(3), counter_init(), epochs=2)
    assert state.handler_metadata["epochs"] == [0, 1]
    # A metric an epoch_completed handler adds is mirrored into that epoch's history.
    assert state.history[0]["extra"] == 2.5 and state.history[1]["extra"] == 2.5
    assert state.metrics["extra"] == 2.5


def test_state_replace_is_immutable_and_validates_fields():
    state = fl.State(epoch=2, metrics={"loss": 1.0})
    changed = state.replace(epoch=3)
    assert (state.epoch, changed.epoch) == (2, 3)
    assert changed.metrics == {"loss": 1.0}
    with pytest.raises(ValueError, match="epoch"):
        state.replace(epochs=3)


def test_step_state_returned_from_epoch_completed_is_adopted():
    data = make_batches(3)

    def reset_counter(state):
        return "continue", state.replace(step_state={**state.step_state, "n": np.int32(100)})

    loop = counter_loop().handle_event("epoch_completed", reset_counter, filter={"once": 1})
    state = loop.run(data, counter_init(), epochs=2)
    assert int(state.step_state["n"]) == 103


def test_step_state_returned_from_an_unfused_iteration_handler_is_adopted():
    def bump(state):
        return "continue", state.replace(step_state={**state.step_state, "n": np.int32(50)})

    loop = counter_loop().handle_event("iteration_completed", bump, filter={"once": 2})
    state = loop.run(make_batches(4), counter_init())
    assert int(state.step_state["n"]) == 52


def test_event_enum_names_work_as_event_arguments():
    log: list = []
    loop = counter_loop().handle_event(fl.Event.EPOCH_COMPLETED, lambda s: log.append(s.epoch))
    loop.run(make_batches(2), counter_init(), epochs=3)
    assert log == [0, 1, 2]
    assert [e.value for e in fl.Event] == list(EVENTS)


def test_a_value_given_where_an_event_goes_is_named_with_its_likely_meaning():
    """Keras habits put labels (validate(model, x, y)) or a metric (checkpoint(path,
    "validation_loss")) in the event slot: the message printed a whole label array."""
    labels = np.arange(400, dtype=np.int32)
    with pytest.raises(ValueError, match=r"event=<ndarray of int32 \(400,\)> is not an event") as e:
        counter_loop().validate(fl.models.mlp([2]), make_batches(2), labels)
    assert "fl.data.arrays(x, y" in str(e.value) and len(str(e.value)) < 400
    with pytest.raises(ValueError, match=r"a metric to save the best by is criteria=\.\.\."):
        counter_loop().checkpoint("unused", "validation_loss")
    # Elsewhere a name is no metric: a misspelt event, another library's name for one.
    meant = {
        "epoch_complete": r"did you mean 'epoch_completed'\?$",
        "on_epoch_end": r"fuseloop's name for 'on_epoch_end' is 'epoch_completed' \(an epoch",
        "train_end": r"'completed' \(a run that halts fires 'halted' instead",
        "on_fit_start": r"is 'started'$",
        ("epoch_completed", "completed"): r"register the handler once for each event$",
    }
    for event, said in meant.items():
        with pytest.raises(ValueError, match=said):
            counter_loop().handle_event(event, lambda s: None)
    with pytest.raises(ValueError, match=r"the event comes before the handler$"):
        counter_loop().handle_event(lambda s: None, "epoch_completed")
    with pytest.raises(ValueError, match=r"a save every 5 epochs is filter=\{'every': 5\}$"):
        counter_loop().checkpoint("unused", 5)
    with pytest.raises(ValueError, match=r"accepted values: [a-z_, ]*$"):  # no data hint
        counter_loop().validate(fl.models.mlp([2]), make_batches(2), "every_epoch")


def test_builders_return_new_loops_and_leave_the_old_unchanged():
    base = counter_loop()
    log: list = []
    with_handler = base.handle_event("epoch_completed", lambda s: log.append(1))
    assert with_handler is not base
    base.run(make_batches(2), counter_init(), epochs=2)
    assert log == []
    with_handler.run(make_batches(2), counter_init(), epochs=2)
    assert log == [1, 1]
    with_metric = trainer().metric("accuracy")
    assert [m.name for m in trainer().metrics] == ["loss", "learning_rate"]
    assert [m.name for m in with_metric.metrics] == ["loss", "learning_rate", "accuracy"]


def test_handler_exceptions_propagate_with_a_note():
    def boom(state):
        raise RuntimeError("boom")

    loop = counter_loop().handle_event("iteration_completed", boom)
    with pytest.raises(RuntimeError, match="boom"):
        loop.run(make_batches(2), counter_init())


def test_a_handler_that_adds_to_a_trainers_step_state_is_named():
    """The trainer's step drops what it does not know, and the error blamed the step."""
    from conftest import make_batches as batches

    def add_ema(state):
        return "continue", state.replace(step_state={**state.step_state, "ema": 0.0})

    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    loop = loop.handle_event("epoch_completed", add_ema)
    for fuse in (False, 2):
        with pytest.raises(ValueError, match=r"add_ema returned .*step_state adds \['ema'\]"):
            loop.run(batches(4), epochs=2, fuse=fuse)

    # A float leaf set to ints (a bias reset with jnp.array([0, 0, 0])) failed at the next
    # step inside jax.grad, naming neither the leaf nor the handler; a cast to another
    # float (bfloat16 on purpose) is the user's to make.
    def reset_bias(state):
        params = state.params["params"]
        bias = np.zeros(params["Dense_0"]["bias"].shape, np.int32)
        reset = {"params": {"Dense_0": {**params["Dense_0"], "bias": bias}}}
        return "continue", state.replace(step_state={**state.step_state, "params": reset})

    resetting = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    resetting = resetting.handle_event("epoch_completed", reset_bias)
    with pytest.raises(ValueError, match=r"reset_bias returned .*\['bias'\] is int32 where"):
        resetting.run(batches(4), epochs=2, fuse=2)

    # The optimizer state's numbers are optax's to take: a rate set to 0 (an int) trains.
    def freeze(state):
        inject = state.step_state["opt_state"]
        rates = {**inject.hyperparams, "learning_rate": np.int32(0)}
        frozen = {**state.step_state, "opt_state": inject._replace(hyperparams=rates)}
        return "continue", state.replace(step_state=frozen)

    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    freezing = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", tx)
    frozen = freezing.handle_event("epoch_completed", freeze).run(batches(4), epochs=3, fuse=2)
    assert frozen.history[1]["loss"] == frozen.history[2]["loss"]


@pytest.mark.parametrize("event", ["epoch_completed", "iteration_completed"])
def test_a_step_state_written_in_place_is_judged_as_a_returned_one(event):
    # Written into in place (returning None), the int bias failed at the next step inside
    # jax.grad, naming neither the leaf nor the handler; an added key failed there too.
    from conftest import make_batches as batches

    def reset_bias(state):
        params = state.step_state["params"]["params"]
        params["Dense_0"]["bias"] = np.zeros(params["Dense_0"]["bias"].shape, np.int32)

    def add_ema(state):
        state.step_state["ema"] = 0.0

    def reset_bias_then_copy(state):  # the copy was compared with the written state
        reset_bias(state)
        return "continue", state.replace(step_state=dict(state.step_state))

    base = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    int_bias = rf"handler of {event} at epoch 0.* in place: .*\['bias'\] is int32 where"
    expected = {
        reset_bias: int_bias,
        reset_bias_then_copy: int_bias,
        add_ema: rf"handler of {event} at epoch 0.* in place: .*step_state adds \['ema'\]",
    }
    for handler, message in expected.items():
        with pytest.raises(ValueError, match=message):
            base.handle_event(event, handler).run(batches(4), epochs=2, fuse=False)


def test_a_handler_filter_or_metric_that_cannot_take_its_arguments_is_refused_when_attached():
    # Each failed only when first called, with Python's TypeError from inside the run.
    class Counter:
        def __call__(self, state):
            return None

    loop = counter_loop()
    refusals = [
        (lambda: loop.handle_event("epoch_completed", lambda a, b: None), r"handler\(state\)"),
        (lambda: loop.handle_event("epoch_completed", Counter), r"a class: pass an instance"),
        (
            lambda: loop.handle_event("epoch_completed", print, filter=lambda: True),
            r"filter\(state\)",
        ),
        (lambda: loop.metric(lambda y: y), r"metric\(y_true, y_pred\)"),
        (lambda: fl.trainer(tiny_mlp(), lambda y: y.mean(), "sgd"), r"loss\(y_true, y_pred\)"),
    ]
    for attach, named in refusals:
        with pytest.raises(ValueError, match=named):
            attach()
    loop.handle_event("epoch_completed", Counter()).metric(lambda t, p, weight=None: p)

    def at_threshold(fn):  # a decorator whose wrapper takes other arguments than fn
        @functools.wraps(fn)
        def wrapper(y_true, y_pred):
            return fn(y_true, y_pred, 0.0)

        return wrapper

    @at_threshold
    def above(y_true, y_pred, threshold):
        return (y_pred[:, 0] > threshold) == (y_true > 0)

    loop.metric(above)  # what is called is the wrapper


def test_a_mock_handler_is_attached_as_it_is():
    """`handle_event` asks a handler's type for the handlers it comes with
    (`fuseloop_companions`): a mock, which answers every attribute, has none."""
    from unittest import mock

    spy = mock.Mock(return_value=None)
    trainer().handle_event("epoch_completed", spy).run(make_batches(2), epochs=2)
    assert [call.args[0].epoch for call in spy.call_args_list] == [0, 1]
