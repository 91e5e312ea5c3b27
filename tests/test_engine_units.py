"""Small engine pieces checked against their references."""

from __future__ import annotations

import itertools

from fuseloop._events import Filter


def test_filter_offsets_match_testing_every_count() -> None:
    keys = itertools.product(
        [None, 1, 2, 3, 7], [None, 1, 5, 30], [None, 0, 3, 20], [None, 1, 4, 25]
    )
    for every, before, after, once in keys:
        spec = Filter(every, before, after, once)
        for first in range(1, 40):
            for n in range(12):
                expected = [j for j in range(n) if spec.by_count(first + j)]
                assert list(spec.offsets(first, n)) == expected, (spec, first, n)


def test_a_packed_snapshot_unpacks_to_the_same_carry() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from conftest import assert_tree_equal, trainer
    from fuseloop.engine.programs import Programs

    programs = Programs(trainer())
    carry = (
        {
            "w": jnp.arange(6.0).reshape(2, 3),
            "step": jnp.int32(7),
            "key": jax.random.key(3),
            "mask": jnp.array([True, False]),
            "empty": jnp.zeros((0, 4)),
            "half": jnp.ones(3, jnp.bfloat16),
        },
        {"acc": {"loss": {"sum": jnp.float32(2.5), "count": jnp.float32(4.0)}}},
    )
    expected = jax.tree.map(lambda a: a, carry)
    back = programs.unpack(programs.pack(carry), carry)
    assert jax.tree.structure(back) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert jnp.array_equal(
        jax.random.key_data(back[0]["key"]), jax.random.key_data(expected[0]["key"])
    )
    del back[0]["key"], expected[0]["key"]
    assert_tree_equal(back, expected)
    assert np.asarray(back[0]["w"]).tobytes() == np.arange(6.0, dtype=np.float32).tobytes()
