"""Spares (engine/start.py, programs.py, docs/design.md §6): a run makes, while the host
waits for the device, the initial step state and accumulators a next run from the same
variables starts from. A run that takes them must be the run that makes its own."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_tree_equal, make_batches, tiny_mlp, trainer


def _inits(loop):
    return list(loop._programs.init.values())


def _fresh_result(variables, batches, **options):
    """The run on a loop of its own: no spare can exist there."""
    return trainer().run(batches, variables, **options)


def test_a_run_from_a_spare_is_the_run_from_a_fresh_init() -> None:
    batches = make_batches(9)
    variables = tiny_mlp().init(jax.random.PRNGKey(3), batches[0][0])
    loop = trainer()
    first = loop.run(batches, variables, fuse=4)
    (init,) = _inits(loop)
    assert init._spare is not None and loop._programs.spare_tail is not None
    second = loop.run(batches, variables, fuse=4)  # starts from the spares
    expected = _fresh_result(variables, batches, fuse=4)
    for state in (first, second):
        assert_tree_equal(state.step_state, expected.step_state, "step state")
        assert state.history == expected.history
    # The caller's variables were never donated.
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(variables))


def test_a_spare_is_taken_once_and_made_again() -> None:
    batches = make_batches(5)
    variables = tiny_mlp().init(jax.random.PRNGKey(1), batches[0][0])
    loop = trainer()
    states = [loop.run(batches, variables, fuse=2, epochs=2) for _ in range(4)]
    for state in states[1:]:  # each took the spare its predecessor made
        assert_tree_equal(state.step_state, states[0].step_state, "step state")
        assert state.history == states[0].history
    handed = [jax.tree.leaves(s.step_state) for s in states]
    ids = [id(leaf) for leaves in handed for leaf in leaves]
    assert len(ids) == len(set(ids)), "two runs were handed the same arrays"


def test_other_variables_do_not_take_the_spare() -> None:
    batches = make_batches(6)
    model = tiny_mlp()
    a = model.init(jax.random.PRNGKey(0), batches[0][0])
    b = model.init(jax.random.PRNGKey(1), batches[0][0])  # same shapes, other values
    copy_of_a = jax.tree.map(lambda leaf: leaf + 0, a)  # same values, other arrays
    loop = trainer()
    loop.run(batches, a, fuse=3)
    for variables in (b, copy_of_a, None):
        state = loop.run(batches, variables, fuse=3)
        expected = _fresh_result(variables, batches, fuse=3)
        assert_tree_equal(state.step_state, expected.step_state, "step state")


def test_host_variables_are_never_spared() -> None:
    """Numpy arrays can change in place between runs: no spare is kept for them."""
    batches = make_batches(4)
    variables = jax.tree.map(np.array, tiny_mlp().init(jax.random.PRNGKey(2), batches[0][0]))
    loop = trainer()
    loop.run(batches, variables, fuse=2)
    (init,) = _inits(loop)
    assert init._spare is None
    jax.tree.leaves(variables)[0][...] = 0.5  # the caller edits its arrays
    state = loop.run(batches, variables, fuse=2)
    expected = _fresh_result(variables, batches, fuse=2)
    assert_tree_equal(state.step_state, expected.step_state, "step state")


def test_deleted_variables_fail_as_without_a_spare() -> None:
    batches = make_batches(4)
    variables = tiny_mlp().init(jax.random.PRNGKey(4), batches[0][0])
    loop = trainer()
    loop.run(batches, variables, fuse=2)
    jax.tree.leaves(variables)[0].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        loop.run(batches, variables, fuse=2)


def test_a_spare_is_made_on_the_device_that_takes_it() -> None:
    """A spare made under one default device is not taken under another."""
    from fuseloop._placement import default_device_key

    batches = make_batches(4)
    variables = tiny_mlp().init(jax.random.PRNGKey(5), batches[0][0])
    loop = trainer()
    loop.run(batches, variables, fuse=2)
    (init,) = _inits(loop)
    assert init._spare[0].device == default_device_key()
    device = jax.devices()[0]
    with jax.default_device(device):
        state = loop.run(batches, variables, fuse=2)
        assert init._spare[0].device == default_device_key()
    assert {leaf.devices().pop() for leaf in jax.tree.leaves(state.step_state)} == {device}


def test_variables_deleted_during_the_run_leave_no_spare() -> None:
    """The spare is made once the run has launched; variables deleted by then (here by
    an `iteration_started` handler, which fires before the first unfused launch) are
    skipped, and the run itself is unaffected."""
    import fuseloop as fl

    batches = make_batches(4)
    variables = tiny_mlp().init(jax.random.PRNGKey(6), batches[0][0])
    kept = jax.tree.map(lambda leaf: leaf + 0, variables)

    def let_go(state):
        for leaf in jax.tree.leaves(variables):
            leaf.delete()

    loop = trainer().handle_event(fl.Event.ITERATION_STARTED, let_go, {"once": 1})
    state = loop.run(batches, variables)
    (init,) = _inits(loop)
    assert init._spare is None
    expected = _fresh_result(kept, batches)
    assert_tree_equal(state.step_state, expected.step_state, "step state")


def _kept_epochs(source) -> list[int]:
    from fuseloop.engine.programs import _ORDERS

    return sorted(epoch for _, epoch, *_ in _ORDERS.get(source, {}))


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_device_datasets_first_order_is_kept_per_start_epoch(fuse) -> None:
    """A resident run takes its first epoch's order from beside the source (no dispatch
    ahead of its first chunk); later runs and runs from other epochs step the order the
    host source serves."""
    batches = make_batches(7)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    source = fl.data.arrays(x, y, batch_size=4, seed=5, shuffle=True, device=True)
    host = fl.data.arrays(x, y, batch_size=4, seed=5, shuffle=True)
    loop = trainer()
    expected = loop.run(host, epochs=3, fuse=fuse)
    runs = [loop.run(source, epochs=3, fuse=fuse) for _ in range(2)]
    assert _kept_epochs(source) == [0]
    one = loop.run(source, epochs=1, fuse=fuse)
    resumed = loop.run(source, one, epochs=3, fuse=fuse)  # starts at epoch 1
    assert _kept_epochs(source) == [0, 1]
    for state in (*runs, resumed):
        assert_tree_equal(state.step_state, expected.step_state, "step state")
        assert state.history == expected.history
