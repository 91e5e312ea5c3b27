"""fuseloop under JAX's other PRNG kinds ("rbg", "unsafe_rbg"), whose raw keys are uint32[4],
and across changes of the settings random bits and initial states depend on.

Solo runs support them exactly as the default threefry: fused == unfused bitwise, and a
device-resident dataset's orders match the host's. A population is refused, since vmapped
rbg bits come from one key for all members (docs/design.md §8). A Loop run again after
such a setting changed runs as a new Loop would.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest

import fuseloop as fl
from conftest import DropoutOnly, assert_runs_identical, make_batches, trainer
from fuseloop import _epoch_order


@pytest.fixture(params=["rbg", "unsafe_rbg"])
def prng_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    before = jax.config.jax_default_prng_impl  # type: ignore[attr-defined]
    jax.config.update("jax_default_prng_impl", request.param)
    try:
        yield request.param
    finally:
        jax.config.update("jax_default_prng_impl", before)


def _arrays(**kwargs: object) -> fl.data.ArraySource:
    x = np.random.default_rng(1).normal(size=(40, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return fl.data.arrays(x, y, batch_size=8, seed=5, **kwargs)


def test_a_dropout_model_trains_fused_as_unfused(prng_kind):
    loop = trainer(DropoutOnly())
    plain = loop.run(make_batches(), epochs=2)
    fused = loop.run(make_batches(), epochs=2, fuse=4)
    assert_runs_identical(fused, plain)
    assert plain.step_state["rng"].shape == (4,)  # the kind's own key, not threefry's


def test_a_resident_dataset_serves_the_hosts_order(prng_kind):
    # Seed 0's key first asked for inside the trace below (for its shape) failed to become
    # host bits when no earlier test had made it: the cache starts empty here.
    _epoch_order._seed_key.cache_clear()
    source = _arrays(device=True)
    assert source.key_data.shape == (4,)
    on_device = np.asarray(jax.jit(source.epoch_indices)(source.key_data, 2))
    assert on_device.ravel().tolist() == source.order(2).tolist()
    # The dropout model and runs of `_runs_again_as_a_new_loop`: the programs are shared.
    loop = trainer(DropoutOnly())
    plain = loop.run(source, epochs=2)
    assert_runs_identical(loop.run(source, epochs=2, fuse="run"), plain)


def test_a_state_made_under_threefry_is_refused_by_name_under_another_kind(prng_kind):
    """The trainer's key is raw key data, 2 words under threefry and 4 under rbg: resumed
    under the other kind, JAX failed inside the first step with "invalid PRNG key data"."""
    loop = trainer(DropoutOnly())
    jax.config.update("jax_default_prng_impl", "threefry2x32")
    saved = loop.run(make_batches(), epochs=1)
    jax.config.update("jax_default_prng_impl", prng_kind)
    with pytest.raises(ValueError, match=r"key holds 2 words, made under another PRNG kind"):
        loop.run(make_batches(), saved, epochs=2)
    loop.run(make_batches(), saved.params, epochs=1)  # its params start a fresh run


def test_a_population_is_refused_with_the_fix(prng_kind):
    with pytest.raises(ValueError, match=f"PRNG kind is '{prng_kind}'.*threefry2x32"):
        trainer().run(_arrays(), epochs=1, population=2)


def test_the_default_kind_keeps_populations():
    state = trainer().run(_arrays(), epochs=1, population=2)
    assert state.member(1).step_state["rng"].shape == (2,)


def _runs_again_as_a_new_loop(setting: str, values: tuple[object, ...]) -> None:
    """A Loop run under each of `values` of the JAX `setting` in turn (shuffled resident data,
    dropout) runs as a new Loop would, unfused and as a whole run."""
    loop, source = trainer(DropoutOnly()), _arrays(device=True)
    before = getattr(jax.config, setting)
    try:
        for value in values:
            jax.config.update(setting, value)
            reused = loop.run(source, epochs=2)
            assert_runs_identical(reused, trainer(DropoutOnly()).run(source, epochs=2))
            assert_runs_identical(loop.run(source, epochs=2, fuse="run"), reused)
    finally:
        jax.config.update(setting, before)


def test_a_loop_run_again_under_another_kind_runs_as_a_new_loop():
    """rbg and unsafe_rbg keys have one shape, so jax's caches would reuse a program traced
    under the other kind (its generator); fuseloop starts its programs afresh instead."""
    _runs_again_as_a_new_loop("jax_default_prng_impl", ("rbg", "unsafe_rbg"))


def test_a_loop_run_again_after_threefry_partitionable_flips_runs_as_a_new_loop():
    """The flag changes every draw: the epoch orders kept beside a resident source, the init
    keys and the initial state made ahead for the next run are made again under it."""
    flag = bool(jax.config.jax_threefry_partitionable)  # type: ignore[attr-defined]
    _runs_again_as_a_new_loop("jax_threefry_partitionable", (flag, not flag))


def test_the_run_after_a_disable_jit_run_starts_as_a_jitted_one():
    """A debugging run under jax.disable_jit() initialises eagerly (other rounding); the
    initial state it made ahead for the next run is not taken by a jitted run."""
    loop, data = trainer(), make_batches(2)
    fresh = trainer().run(data)
    with jax.disable_jit():
        loop.run(data)
    assert_runs_identical(loop.run(data), fresh)
