"""What fuseloop finds out about an optimizer before it trusts it: which injected
hyperparameters a schedule recomputes (so a reduction or a population member's value
would be overwritten), what a learning-rate metric may report, and which updates take the
extra arguments a hand-written optax loop passes."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest

import fuseloop as fl
from fuseloop._rate_groups import inject_states

LOSS = "sparse_categorical_cross_entropy"
_rng = np.random.default_rng(0)
X = _rng.normal(size=(48, 5)).astype(np.float32)
Y = _rng.integers(0, 3, 48).astype(np.int32)
DATA = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 48, 8)]
MODEL = fl.models.mlp([8, 3])
# In the shapes MODEL.init gives, drawn on the host: an eager init at import compiles a
# program per op (in every test process that collects this file).
VARIABLES = jax.tree.map(
    lambda s: _rng.normal(0, 0.5, s.shape).astype(s.dtype),
    jax.eval_shape(lambda x: MODEL.init(jax.random.PRNGKey(0), x), X[:8]),
)
SCHEDULE = optax.linear_schedule(1e-2, 1e-4, 40)


def _injected(schedule=SCHEDULE, **others):
    return optax.inject_hyperparams(optax.adam)(learning_rate=schedule, **others)


@pytest.mark.parametrize(
    "tx",
    [
        optax.MultiSteps(_injected(), every_k_schedule=2),
        optax.chain(_injected(), optax.contrib.reduce_on_plateau(patience=100)),
        optax.multi_transform(
            {"body": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), "head": _injected()},
            lambda params: jax.tree.map(lambda _: "head", params),
        ),
    ],
    ids=["multisteps", "extra-args-chain", "one-group-of-two"],
)
def test_a_scheduled_rate_behind_a_wrapper_is_refused_by_reduce_lr_on_plateau(tx):
    with pytest.raises(ValueError, match="optax schedule, recomputed at every step"):
        fl.trainer(MODEL, LOSS, tx).reduce_lr_on_plateau("loss")


def test_a_scheduled_rate_found_only_with_the_runs_params_is_refused_at_its_first_reduction():
    labels = jax.tree.map(lambda _: "all", VARIABLES["params"])  # a pytree: needs the params
    tx = optax.multi_transform({"all": _injected()}, labels)
    loop = fl.trainer(MODEL, LOSS, tx).reduce_lr_on_plateau("loss", patience=0, min_delta=10.0)
    with pytest.raises(ValueError, match="optax schedule, recomputed at every step"):
        loop.run(DATA, VARIABLES, epochs=3)


def test_a_plateau_handler_attached_by_handle_event_is_checked_as_the_builder_checks_it():
    """As docs/handlers.md attaches it beside validate(filter=...): a scheduled rate ran,
    every reduction overwritten at the next step; a fixed rate failed at its first one."""
    from fuseloop.handlers.monitor import ReduceLROnPlateau

    for tx, refusal in ((_injected(), "optax schedule"), (optax.adam(1e-2), "fixed inside")):
        with pytest.raises(ValueError, match=f"learning rate: it is (an )?{refusal}"):
            fl.trainer(MODEL, LOSS, tx).handle_event(
                "epoch_completed", ReduceLROnPlateau("loss", patience=0), filter={"every": 2}
            )
    # A custom loop's step state may hold an injected rate: checked when it runs, as before.
    custom = fl.loop(lambda batch, s: s).handle_event("epoch_completed", ReduceLROnPlateau("n"))
    assert isinstance(custom, fl.Loop)


def test_a_population_of_a_scheduled_hyperparameter_is_refused_by_name():
    tx = _injected(1e-2, b1=optax.linear_schedule(0.8, 0.95, 20))
    with pytest.raises(ValueError, match=r"population: 'b1' is recomputed by a schedule"):
        fl.trainer(MODEL, LOSS, tx).run(DATA, population={"b1": [0.1, 0.99]})
    many = optax.MultiSteps(_injected(), every_k_schedule=2)
    with pytest.raises(ValueError, match=r"'learning_rate' is recomputed by a schedule"):
        fl.trainer(MODEL, LOSS, many).run(DATA, population={"learning_rate": [1e-3, 1e-2]})
    # Nested in a chain or a group, MultiSteps applies its inner update (where the schedule
    # writes) only at its k-th update: the probe's one update did not reach it.
    # Accumulating over thousands of updates: probed on the device, in one dispatch.
    labels = jax.tree.map(lambda _: "all", VARIABLES["params"])
    for k in (3, 2000):
        nested = optax.MultiSteps(_injected(), every_k_schedule=k).gradient_transformation()
        twice = optax.MultiSteps(optax.chain(nested), every_k_schedule=2)  # in another's
        for tx in (
            optax.chain(nested),
            optax.multi_transform({"all": nested}, labels),
            optax.chain(twice.gradient_transformation()),
        ):
            with pytest.raises(ValueError, match=r"'learning_rate' is recomputed by a sch"):
                fl.trainer(MODEL, LOSS, tx).run(DATA, population={"learning_rate": [0.1, 0.2]})
    fixed = optax.MultiSteps(_injected(1e-2), every_k_schedule=2000).gradient_transformation()
    grouped = optax.multi_transform({"all": fixed}, labels)
    rates = [0.1, 0.2]
    state = fl.trainer(MODEL, LOSS, grouped).run(DATA, population={"learning_rate": rates})
    held = [n.hyperparams["learning_rate"] for n in inject_states(state.step_state["opt_state"])]
    np.testing.assert_allclose(np.ravel(held), rates)


def _skips_zero_gradients(updates, gradient_step, params):
    """A MultiSteps' `should_skip_update_fn` that skips a batch whose gradients are all zero
    (a padded or empty micro-batch)."""
    zero = jax.numpy.all(jax.numpy.stack([jax.numpy.all(u == 0) for u in jax.tree.leaves(updates)]))
    return zero, {}


def _zero_skipping(schedule):
    """A MultiSteps skipping zero gradients, nested in a chain: the schedule probe only sees
    its inner update once it has applied."""
    steps = optax.MultiSteps(_injected(schedule), 2, should_skip_update_fn=_skips_zero_gradients)
    return optax.chain(optax.clip(1.0), steps.gradient_transformation())


def test_a_multisteps_that_skips_zero_gradients_is_probed_as_any_other():
    """The probe's gradients are small, not zero: one skipping zero gradients never applied
    under it, so a constant rate's population was refused and reduce_lr_on_plateau took a
    schedule it would have overwritten."""
    rates = [0.1, 0.2]
    loop = fl.trainer(MODEL, LOSS, _zero_skipping(1e-2))
    state = loop.run(DATA, VARIABLES, population={"learning_rate": rates})
    held = [n.hyperparams["learning_rate"] for n in inject_states(state.step_state["opt_state"])]
    np.testing.assert_allclose(np.ravel(held), rates)
    assert loop.reduce_lr_on_plateau("loss").run(DATA, VARIABLES).status == "completed"
    scheduled = fl.trainer(MODEL, LOSS, _zero_skipping(SCHEDULE))
    with pytest.raises(ValueError, match="optax schedule, recomputed at every step"):
        scheduled.reduce_lr_on_plateau("loss").run(DATA, VARIABLES)
    with pytest.raises(ValueError, match=r"'learning_rate' is recomputed by a schedule"):
        scheduled.run(DATA, VARIABLES, population={"learning_rate": rates})


def test_a_multisteps_that_skips_large_updates_is_probed_on_the_runs_params():
    """The probe's small gradients add up, over a model's params, to a norm that a spike
    guard of a MultiSteps may skip: it then probes with zeros, which any norm passes (a
    constant rate was refused, reduce_lr_on_plateau too)."""

    def skips_large(updates, gradient_step, params):  # the probe's norm^2 here: 7.5e-7
        return optax.skip_large_updates(updates, gradient_step, params, 1e-7)

    steps = optax.MultiSteps(_injected(1e-2), 2, should_skip_update_fn=skips_large)
    labels = jax.tree.map(lambda _: "all", VARIABLES["params"])  # probed on the run's params
    tx = optax.multi_transform({"all": steps.gradient_transformation()}, labels)
    loop = fl.trainer(MODEL, LOSS, tx)
    assert loop.reduce_lr_on_plateau("loss").run(DATA, VARIABLES).status == "completed"
    rates = [0.1, 0.2]
    state = loop.run(DATA, VARIABLES, population={"learning_rate": rates})
    held = [n.hyperparams["learning_rate"] for n in inject_states(state.step_state["opt_state"])]
    np.testing.assert_allclose(np.ravel(held), rates)


def test_reduce_lr_on_plateau_refuses_an_optimizer_its_probe_cannot_see_apply():
    """A nested MultiSteps that skips every update never applies its inner one: whether a
    schedule there rewrites the rate is unknown, and a reduction could vanish in silence."""
    always = optax.MultiSteps(_injected(1e-2), 2, should_skip_update_fn=lambda u, s, p: (True, {}))
    loop = fl.trainer(MODEL, LOSS, optax.chain(always.gradient_transformation()))
    with pytest.raises(ValueError, match="probe of the optimizer .* failed or never applied"):
        loop.reduce_lr_on_plateau("loss").run(DATA, VARIABLES)


_FROZEN_FIRST = {name: ("frozen" if name == "Dense_0" else "head") for name in VARIABLES["params"]}


def _frozen_first(learning_rate, labels):
    """A fine-tuning optimizer: the first layer frozen, the rest trained by an injected
    adam. Its state depends on the params' structure (a tree of labels, or a function that
    names the layers), so no stand-in of params shows its hyperparameters."""
    head = optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)
    return optax.multi_transform({"head": head, "frozen": optax.set_to_zero()}, labels)


@pytest.mark.parametrize(
    "labels", [_FROZEN_FIRST, lambda params: _FROZEN_FIRST], ids=["tree", "naming-function"]
)
def test_a_population_of_a_structure_dependent_optimizer_is_checked_on_the_runs_params(labels):
    rates = [1e-2, 5e-2]
    loop = fl.trainer(MODEL, LOSS, _frozen_first(1e-3, labels))
    population = loop.run(DATA, VARIABLES, epochs=2, population={"learning_rate": rates})
    for i, rate in enumerate(rates):
        member = population.member(i).params["params"]
        solo = fl.trainer(MODEL, LOSS, _frozen_first(rate, labels)).run(DATA, VARIABLES, epochs=2)
        frozen = VARIABLES["params"]["Dense_0"]
        assert all(np.array_equal(member["Dense_0"][k], frozen[k]) for k in frozen)
        for got, want in zip(
            jax.tree.leaves(member), jax.tree.leaves(solo.params["params"]), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # vmap: a few ulps
    again = loop.run(DATA, VARIABLES, epochs=2, population={"learning_rate": rates[::-1]})
    assert again.stats["compiles"] == 0


def test_a_structure_dependent_optimizers_population_is_refused_where_its_state_says_so():
    labels = jax.tree.map(lambda _: "all", VARIABLES["params"])
    adam = optax.multi_transform({"all": optax.inject_hyperparams(optax.adam)(1e-2)}, labels)
    accepted = r"'momentum' is not .* accepted: seed, b1, b2, eps, eps_root, learning_rate "
    with pytest.raises(ValueError, match=accepted):
        fl.trainer(MODEL, LOSS, adam).run(DATA, population={"momentum": [0.8, 0.9]})
    scheduled = optax.multi_transform({"all": _injected()}, labels)
    with pytest.raises(ValueError, match=r"population: 'learning_rate' is recomputed by a sch"):
        fl.trainer(MODEL, LOSS, scheduled).run(DATA, population={"learning_rate": [0.1, 0.2]})
    whole = optax.multi_transform({"all": optax.inject_hyperparams(optax.sgd)(1)}, labels)
    with pytest.raises(ValueError, match=r"keeps learning_rate as int32 .* 0.5 would be cut"):
        fl.trainer(MODEL, LOSS, whole).run(DATA, population={"learning_rate": [0.5, 1.0]})


def test_an_injected_hyperparameter_that_is_a_tree_trains():
    # inject_hyperparams reads a function as a schedule of the step count: adamw's mask
    # given as one that returns the layers' tree is a hyperparameter that is a tree.
    decayed = {name: {"bias": False, "kernel": True} for name in VARIABLES["params"]}
    mask = lambda _: decayed  # noqa: E731
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, mask=mask)
    state = fl.trainer(MODEL, LOSS, tx).run(DATA, VARIABLES)
    assert state.status == "completed" and np.isfinite(state.metrics["loss"])


def test_the_learning_rate_metric_is_a_rate_never_a_scale_of_the_users_own():
    multiplied = optax.chain(optax.adam(1e-3), optax.scale_by_schedule(SCHEDULE))
    state = fl.trainer(MODEL, LOSS, multiplied).run(DATA, epochs=2)
    assert "learning_rate" not in state.history[1]  # no one number is the rate
    scheduled = fl.trainer(MODEL, LOSS, optax.adam(SCHEDULE)).run(DATA, epochs=2)
    assert scheduled.history[1]["learning_rate"] == pytest.approx(float(SCHEDULE(11)))


def test_multisteps_passes_the_extra_arguments_on_as_a_hand_written_loop_does():
    def make():
        inner = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1))
        return optax.MultiSteps(inner, every_k_schedule=2)

    state = fl.trainer(MODEL, LOSS, make()).run(DATA, VARIABLES, epochs=2, fuse=3)
    tx, params = make(), VARIABLES
    opt_state = jax.jit(tx.init)(params["params"])  # zeros: one program, not one per op

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = MODEL.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state

    trained = params["params"]
    for _ in range(2):
        for x, y in DATA:
            trained, opt_state = step(trained, opt_state, x, y)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lookahead_is_refused_when_the_trainer_is_built_with_the_custom_loop_that_works():
    # optax.lookahead steps LookaheadParams, not a model's params: optax's own init failed
    # inside the first run with "'dict' object has no attribute 'fast'".
    tx = optax.lookahead(optax.adam(1e-3), sync_period=2, slow_step_size=0.5)
    with pytest.raises(ValueError, match=r"optax.lookahead trains optax.LookaheadParams.*fl.loop"):
        fl.trainer(fl.models.mlp([3]), "mean_squared_error", tx)
    wrapped = optax.chain(optax.clip(1.0), optax.adam(1e-3))  # only lookahead itself
    assert isinstance(fl.trainer(fl.models.mlp([3]), "mean_squared_error", wrapped), fl.Loop)


@pytest.mark.parametrize("wrap", ["chain", "multi_steps"])
def test_a_lookahead_inside_a_chain_or_multi_steps_is_refused_at_the_run_start(wrap):
    # Built into another transformation it was not seen when the trainer was built, and
    # the run failed inside optax with "'dict' object has no attribute 'fast'".
    lookahead = optax.lookahead(optax.adam(1e-3), sync_period=2, slow_step_size=0.5)
    tx = (
        optax.chain(optax.clip_by_global_norm(1.0), lookahead)
        if wrap == "chain"
        else optax.MultiSteps(lookahead, 2)
    )
    with pytest.raises(ValueError, match=r"optax.lookahead trains optax.LookaheadParams.*fl.loop"):
        fl.trainer(MODEL, LOSS, tx).run(DATA, VARIABLES)


def test_a_mask_function_injected_as_a_schedule_is_said_to_mask_nothing_by_param():
    # inject_hyperparams calls it with the step count: one bool for every param.
    by_rank = lambda params: jax.tree.map(lambda leaf: leaf.ndim > 1, params)  # noqa: E731
    scheduled = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, mask=by_rank)
    with pytest.warns(UserWarning, match=r"one bool for every param.*static_args=\('mask',\)"):
        fl.trainer(MODEL, LOSS, scheduled).run(DATA, VARIABLES)
    static = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.trainer(MODEL, LOSS, static(learning_rate=1e-2, mask=by_rank)).run(DATA, VARIABLES)
