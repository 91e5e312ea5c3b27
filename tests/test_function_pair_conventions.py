"""Conventions of a plain `(init_fn, apply_fn)` pair that fuseloop cannot see through, or
used to misread: haiku's stateful transform, a flag init requires, randomness drawn in
evaluation, and a signature a wrapper hides."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import CLASSES, make_batches

DATA = make_batches(6)
SPARSE = "sparse_categorical_cross_entropy"


def _init(rng: Any, x: Any) -> dict[str, Any]:
    return {"w": jax.random.normal(jax.random.PRNGKey(0), (x.shape[1], CLASSES)) * 0.5}


def test_a_separate_state_as_haikus_transform_with_state_makes_it_is_refused_by_name():
    # It was refused as needing a key fuseloop does not supply, or as x misfitting.
    def apply(params, state, rng, x):
        return x @ params["w"], state

    with pytest.raises(fl.models.ModelConventionError, match=r"transform_with_state.*fl\.loop"):
        fl.trainer((_init, apply), SPARSE, "sgd")


def test_an_input_named_state_is_no_haiku_state():
    # An agent's observation: apply(params, state) and a policy's (params, state, rng) train.
    loop = fl.trainer((_init, lambda params, state: state @ params["w"]), SPARSE, "sgd")
    assert loop.run(DATA).status == "completed"
    policy = lambda params, state, rng=None, training=False: state @ params["w"]  # noqa: E731
    assert fl.trainer((_init, policy), SPARSE, "sgd").run(DATA).status == "completed"


def test_a_linen_apply_under_jit_is_read_as_the_modules_own():
    # jax.jit keeps flax's (variables, *args) signature: it was warned about as a wrapper
    # hiding x, and a module with a train flag went through in evaluation mode.
    plain = fl.models.mlp([4, CLASSES])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer((plain.init, jax.jit(plain.apply)), SPARSE, "sgd")
    flagged = _Dropping()
    wrappers = (
        jax.jit(flagged.apply),
        jax.checkpoint(flagged.apply),
        functools.partial(flagged.apply, method=_Dropping.__call__),
        functools.partial(flagged.apply, method="__call__"),
    )
    for wrapped in wrappers:
        with pytest.raises(fl.models.ModelConventionError, match=r"_Dropping\(\.\.\.\)"):
            fl.trainer((flagged.init, wrapped), SPARSE, "sgd")


class _Dropping(nn.Module):
    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        return nn.Dense(CLASSES)(nn.Dropout(0.5, deterministic=not train)(x))


def test_a_static_flag_after_the_key_goes_by_position():
    # `apply(params, x, rng=None, train=False)` under static_argnums=(3,): rng and the
    # flag went by keyword, and jax.checkpoint refused the call (blamed on x's shape).
    def apply(params, x, rng=None, train=False):
        if train:
            x = x * jax.random.bernoulli(rng, 0.5, x.shape) * 2.0
        return x @ params["w"]

    static = jax.checkpoint(apply, static_argnums=(3,))
    runs = [fl.trainer((_init, static), SPARSE, "sgd").run(DATA, fuse=f) for f in (False, 3)]
    plain = fl.trainer((_init, apply), SPARSE, "sgd").run(DATA)
    np.testing.assert_array_equal(runs[0].params["w"], plain.params["w"])
    np.testing.assert_array_equal(runs[1].params["w"], plain.params["w"])

    # A default between x and the flag stays unpassed: jax.jit, which names its static
    # arguments, would trace it given by position.
    def deep(params, x, depth=2, train=False):
        for _ in range(depth):
            x = x * 1.0
        return apply(params, x)

    named = jax.jit(deep, static_argnames=("train",))
    assert fl.trainer((_init, named), SPARSE, "sgd").run(DATA).status == "completed"
    # static_argnums past the arguments given: jax's refusal is told as the model's.
    beyond = jax.checkpoint(apply, static_argnums=(5,))
    with pytest.raises(ValueError, match=r"^model: .*check static_argnums against the sig"):
        fl.trainer((_init, beyond), SPARSE, "sgd").run(DATA)


def test_a_flag_init_requires_gets_its_evaluation_value():
    # haiku's usual `f(x, is_training)`: init takes the flag too, and was called without it.
    flags_at_init: list[bool] = []

    def init(rng, x, is_training):
        flags_at_init.append(is_training)
        return _init(rng, x)

    def apply(params, rng, x, is_training):
        if is_training:
            x = x * jax.random.bernoulli(rng, 0.5, x.shape) * 2.0
        return x @ params["w"]

    loop = fl.trainer((init, apply), SPARSE, "sgd")
    unfused = loop.run(DATA, epochs=2)
    fused = loop.run(DATA, epochs=2, fuse=3)
    assert flags_at_init and not any(flags_at_init)
    np.testing.assert_array_equal(fused.params["w"], unfused.params["w"])
    # Dropout was on while training: the params differ from a run that never drew it.
    steady = fl.trainer((init, lambda p, rng, x, is_training: x @ p["w"]), SPARSE, "sgd")
    assert not np.array_equal(steady.run(DATA, epochs=2).params["w"], unfused.params["w"])

    # By position, as for apply: a flag static by position was traced given by keyword.
    def branching_init(rng, x, is_training):
        return _init(rng, x * 2.0 if is_training else x)

    static = jax.checkpoint(branching_init, static_argnums=(2,))
    assert fl.trainer((static, apply), SPARSE, "sgd").run(DATA).status == "completed"


def _always_noisy(params: Any, x: Any, rng: Any = None) -> Any:
    return (x + jax.random.normal(rng, x.shape)) @ params["w"]


def test_randomness_drawn_in_evaluation_is_told_to_stay_behind_the_train_flag():
    state = fl.trainer((_init, _always_noisy), SPARSE, "sgd").run(DATA)
    with pytest.raises(ValueError, match=r"draws randomness in evaluation.*only while training"):
        fl.predict((_init, _always_noisy), state.params, DATA[0][0])


def test_an_apply_whose_signature_a_wrapper_hides_is_warned_about():
    def apply(params, x, train=False):
        return x @ params["w"]

    def logged(*args, **kwargs):  # no functools.wraps: the signature reads (*args, **kwargs)
        return apply(*args, **kwargs)

    with pytest.warns(UserWarning, match=r"names no x.*functools\.wraps"):
        fl.trainer((_init, logged), SPARSE, "sgd")
    with warnings.catch_warnings():  # the same apply, its signature readable
        warnings.simplefilter("error")
        fl.trainer((_init, apply), SPARSE, "sgd")


def _dropping(params: Any, x: Any, training: bool = False, rng: Any = None) -> Any:
    if training:
        x = x * jax.random.bernoulli(rng, 0.5, x.shape) * 2.0
    return x @ params["w"]


def test_a_flag_made_static_by_position_is_passed_by_position():
    # jax.checkpoint's static_argnums count positions: passed by keyword, the flag was
    # traced and the run refused as x misfitting the model.
    checkpointed = jax.checkpoint(_dropping, static_argnums=(2,))
    loop = fl.trainer((_init, checkpointed), SPARSE, "sgd")
    unfused = loop.run(DATA, epochs=2)
    np.testing.assert_array_equal(loop.run(DATA, epochs=2, fuse=3).params["w"], unfused.params["w"])
    plain = fl.trainer((_init, _dropping), SPARSE, "sgd").run(DATA, epochs=2)
    np.testing.assert_allclose(unfused.params["w"], plain.params["w"], rtol=1e-6)


def test_a_wrapper_taking_the_flag_by_name_gets_it_by_name():
    # A functools.wraps wrapper `(params, x, **kw)` shows the flag after x, but takes it
    # by name only: passed by position it failed as x misfitting the model.
    seen: list[bool] = []

    def apply(params: Any, x: Any, train: bool = False) -> Any:
        seen.append(train)
        return x @ params["w"]

    @functools.wraps(apply)
    def wrapper(params: Any, x: Any, **kw: Any) -> Any:
        return apply(params, x, **kw)

    fl.trainer((_init, wrapper), SPARSE, "sgd").run(DATA)
    assert True in seen and False in seen


def _dropout(params: Any, x: Any, on: bool, rng: Any) -> Any:
    h = x @ params["w"]
    if on:
        h = h * jax.random.bernoulli(rng, 0.5, h.shape) * 2.0
    return h


@pytest.mark.parametrize("name, default", [("is_train", False), ("frozen", True)])
def test_a_train_flag_of_another_name_is_refused_where_it_would_keep_dropout_off(name, default):
    # It was never passed: every step trained with dropout off, with no word.
    def apply(params, x, rng=None, **flag):
        on = flag.get(name, default) != default
        return _dropout(params, x, on and rng is not None, rng)

    apply.__signature__ = _signature_with(apply, name, default)
    loop = fl.trainer((_init, apply), SPARSE, "sgd")
    wrap = "train" if default is False else "not train"
    with pytest.raises(fl.models.ModelModeError, match=rf"{name}={default}.*{name}={wrap}, rng"):
        loop.run(DATA, fuse=False)


def _signature_with(fn: Any, name: str, default: bool) -> Any:
    """`fn`'s signature as `(params, x, rng=None, <name>=<default>)`."""
    parameter = inspect.Parameter
    return inspect.Signature(
        [
            parameter("params", parameter.POSITIONAL_OR_KEYWORD),
            parameter("x", parameter.POSITIONAL_OR_KEYWORD),
            parameter("rng", parameter.POSITIONAL_OR_KEYWORD, default=None),
            parameter(name, parameter.KEYWORD_ONLY, default=default),
        ]
    )


def test_a_bool_option_is_no_train_flag_where_the_call_draws_or_has_one():
    # A bias option changes no draws; extra noise added to a call that draws already, or
    # beside a flag fuseloop passes, is an option left off on purpose: trained as given.
    def biased(params, x, rng=None, bias=False):
        return _dropout(params, x, rng is not None, rng) + (1.0 if bias else 0.0)

    def noisier(params, x, rng=None, extra_noise=False):
        h = _dropout(params, x, rng is not None, rng)
        return _dropout({"w": params["w"] * 0 + 1}, h, extra_noise, rng) if extra_noise else h

    def flagged(params, x, rng=None, train=False, extra_noise=False):
        h = _dropout(params, x, train, rng)
        return h + jax.random.normal(rng, h.shape) if extra_noise else h

    for apply in (biased, noisier, flagged):
        assert fl.trainer((_init, apply), SPARSE, "sgd").run(DATA).status == "completed"


def test_a_wrapper_passing_the_rest_on_after_x_is_warned_of():
    # (params, x, *args, **kwargs) hid the flag as (params, *args) does, but went unsaid.
    def inner(params, x, train=False, rng=None):
        return _dropout(params, x, train, rng)

    def apply(params, x, *args, **kwargs):
        return inner(params, x / 2, *args, **kwargs)

    with pytest.warns(UserWarning, match=r"names nothing after x"):
        fl.trainer((_init, apply), SPARSE, "sgd")


def test_a_state_returned_beside_the_output_while_training_is_refused():
    # A custom loss picking y_pred[0] (the tuple-output advice) trained, and the returned
    # BatchNorm statistics were dropped: params["bn"] trained by gradients instead.
    def init(rng, x):
        return {**_init(rng, x), "bn": {"mean": np.zeros(CLASSES, np.float32)}}

    def apply(params, x, train=False):
        h = x @ params["w"]
        if not train:
            return h - params["bn"]["mean"]
        return h - h.mean(0), {"bn": {"mean": 0.9 * params["bn"]["mean"] + 0.1 * h.mean(0)}}

    def loss(y: Any, y_pred: Any) -> Any:  # the tuple-output advice: pick the output
        return optax.softmax_cross_entropy_with_integer_labels(y_pred[0], y).mean()

    loop = fl.trainer((init, apply), loss, "sgd")
    with pytest.raises(fl.models.ModelConventionError, match=r"returns \(out, state\).*fl\.loop"):
        loop.run(DATA)


def test_a_state_parameter_before_x_is_refused_as_a_separate_state():
    # apply(params, state, x, train) was told x does not fit, with linen's advice.
    def apply(params, state, x, train=False):
        return x @ params["w"], state

    with pytest.raises(fl.models.ModelConventionError, match=r"\(params, state, x, train\)"):
        fl.trainer((_init, apply), SPARSE, "sgd")


def test_a_jitted_apply_whose_flag_is_traced_is_told_to_make_it_static():
    # It was blamed on x's shape ("Give x the shape the model expects").
    def apply(params, x, train=False, rng=None):
        return _dropout(params, x, train, rng)

    loop = fl.trainer((_init, jax.jit(apply)), SPARSE, "sgd")
    with pytest.raises(ValueError, match=r"static_argnames=\('<the flag>',\)") as caught:
        loop.run(DATA)
    assert "shape the model expects" not in str(caught.value)
    static = fl.trainer((_init, jax.jit(apply, static_argnames="train")), SPARSE, "sgd")
    assert static.run(DATA).status == "completed"


def test_a_training_only_auxiliary_output_is_no_returned_state():
    # An array beside the output (an auxiliary loss, an attention map) was taken as a
    # state shaped as a params leaf and refused.
    def with_aux(params, x, train=False):
        h = x @ params["w"]
        return (h, 0.01 * jax.numpy.mean(h**2)) if train else h

    def with_map(params, x, train=False):
        h = x @ params["w"]
        return (h, jax.nn.softmax(h)) if train else h

    def loss(y: Any, y_pred: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(y_pred[0], y).mean()

    for apply in (with_aux, with_map):
        assert fl.trainer((_init, apply), loss, "sgd").run(DATA).status == "completed"


def test_a_hidden_flag_is_told_with_the_key_it_takes_and_an_option_can_be_bound():
    def apply(params, x, greedy=True, key=None):
        h = x @ params["w"]
        return h if greedy else h + jax.random.gumbel(key, h.shape)

    with pytest.raises(fl.models.ModelModeError) as caught:
        fl.trainer((_init, apply), SPARSE, "sgd").run(DATA)
    said = str(caught.value)
    assert "lambda params, x, train=False, key=None: apply_fn(params, x, greedy=not train" in said
    assert "functools.partial(apply_fn, greedy=True)" in said
    kept = functools.partial(apply, greedy=True)  # an option kept off in training: taken
    assert fl.trainer((_init, kept), SPARSE, "sgd").run(DATA).status == "completed"
    wrapped = lambda params, x, train=False, key=None: apply(params, x, greedy=not train, key=key)  # noqa: E731
    assert fl.trainer((_init, wrapped), SPARSE, "sgd").run(DATA).status == "completed"


def test_an_agents_state_and_action_are_not_a_state_beside_the_params():
    # apply(params, state, action) was told it reads as hk.transform_with_state.
    def apply(params, state, action):
        return state @ params["w"] + action

    with pytest.raises(ValueError) as caught:
        fl.trainer((_init, apply), SPARSE, "sgd").run(DATA)
    assert "transform_with_state" not in str(caught.value)
