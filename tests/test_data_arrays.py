"""`fl.data.arrays`: validation, batching, per-epoch shuffling, pytrees, and the
device-resident variant (one transfer, identical results to the host source)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl

N, FEATURES, CLASSES = 48, 3, 2


def _xy(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int32)
    return x, y


def _expected_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The documented contract: the order depends only on (seed, epoch)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), epoch)
    return np.asarray(jax.random.permutation(key, n))


def _labels(source, epoch: int) -> list[list[int]]:
    return [yb.tolist() for _, yb in source.iter_epoch(epoch)]


# --------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"batch_size": 0}, ["batch_size"]),
        ({"batch_size": -3}, ["batch_size"]),
        ({"batch_size": 2.0}, ["batch_size"]),
        ({"batch_size": True}, ["batch_size"]),
        ({"batch_size": N + 1}, ["batch_size", "drop_remainder"]),
        ({"batch_size": 4, "seed": -1}, ["seed"]),
        ({"batch_size": 4, "seed": 2**32}, ["seed"]),
        ({"batch_size": 4, "shuffle": "yes"}, ["shuffle"]),
        ({"batch_size": 4, "drop_remainder": None}, ["drop_remainder"]),
        ({"batch_size": 4, "device": 1}, ["device"]),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(kwargs, words):
    x, y = _xy()
    with pytest.raises(ValueError) as info:
        fl.data.arrays(x, y, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_mismatched_leading_sizes_name_the_leaves():
    x, y = _xy()
    with pytest.raises(ValueError) as info:
        fl.data.arrays({"image": x, "meta": x[:40]}, y, batch_size=4)
    message = str(info.value)
    assert "image" in message and "meta" in message and "40" in message and str(N) in message


def test_scalar_leaves_and_empty_data_are_rejected():
    x, y = _xy()
    with pytest.raises(ValueError, match="scalar"):
        fl.data.arrays({"x": x, "scale": np.float32(2.0)}, y, batch_size=4)
    with pytest.raises(ValueError, match="no examples"):
        fl.data.arrays(x[:0], y[:0], batch_size=4, drop_remainder=False)
    with pytest.raises(ValueError, match="x has no arrays"):
        fl.data.arrays({}, y, batch_size=4)


def test_batch_larger_than_data_without_drop_remainder_gives_one_short_batch():
    x, y = _xy()  # the file's size: its order's programs are compiled once for the module
    source = fl.data.arrays(x, y, batch_size=N + 16, drop_remainder=False)
    batches = list(source)
    assert len(source) == 1 and [b[1].shape for b in batches] == [(N,)]


# --------------------------------------------------------------------- batching
@pytest.mark.parametrize("drop_remainder", [True, False])
def test_each_epoch_serves_every_example_at_most_once(drop_remainder):
    x, y = _xy()  # 48 = 4 x 10 + 8
    source = fl.data.arrays(x, np.arange(N), batch_size=10, drop_remainder=drop_remainder)
    sizes = [yb.shape[0] for _, yb in source.iter_epoch(3)]
    served = np.concatenate([yb for _, yb in source.iter_epoch(3)])
    if drop_remainder:
        assert len(source) == 4 and sizes == [10] * 4
    else:
        assert len(source) == 5 and sizes == [10] * 4 + [8]
    assert len(set(served.tolist())) == len(served)
    # the examples travel together: x rows match their labels
    for xb, yb in source.iter_epoch(3):
        np.testing.assert_array_equal(xb, x[yb])


def test_batches_are_numpy_with_the_input_dtypes():
    x, y = _xy()
    xb, yb = next(iter(fl.data.arrays(x, y, batch_size=4)))
    assert isinstance(xb, np.ndarray) and isinstance(yb, np.ndarray)
    assert xb.dtype == np.float32 and yb.dtype == np.int32 and xb.shape == (4, FEATURES)


def test_source_keeps_its_own_copy_of_the_arrays():
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=4, shuffle=False)
    before = _labels(source, 0)
    y[:] = 7
    assert _labels(source, 0) == before


def test_pytree_inputs_are_batched_leaf_by_leaf():
    x, y = _xy()
    tree = {"a": x, "b": {"c": np.arange(N * 2).reshape(N, 2)}}
    source = fl.data.arrays(tree, (y, y * 2), batch_size=6, seed=4)
    for xb, (y1, y2) in source.iter_epoch(2):
        assert set(xb) == {"a", "b"} and xb["b"]["c"].shape == (6, 2)
        rows = xb["b"]["c"][:, 0] // 2  # the example index, recovered from the leaf
        np.testing.assert_array_equal(xb["a"], x[rows])
        np.testing.assert_array_equal(y1, y[rows])
        np.testing.assert_array_equal(y2, 2 * y[rows])


# --------------------------------------------------------------------- order
def test_order_is_the_documented_permutation_of_seed_and_epoch():
    x, y = _xy()
    source = fl.data.arrays(x, np.arange(N), batch_size=8, seed=11)
    for epoch in (0, 1, 5):
        expected = _expected_order(11, epoch, N).reshape(-1, 8).tolist()
        assert _labels(source, epoch) == expected


def test_same_seed_same_order_different_epochs_and_seeds_differ():
    x, y = _xy()
    a = fl.data.arrays(x, np.arange(N), batch_size=8, seed=3)
    b = fl.data.arrays(x, np.arange(N), batch_size=8, seed=3)
    c = fl.data.arrays(x, np.arange(N), batch_size=8, seed=4)
    assert _labels(a, 2) == _labels(b, 2)
    assert _labels(a, 2) == _labels(a, 2)  # re-reading an epoch repeats it
    assert _labels(a, 0) != _labels(a, 1)
    assert _labels(a, 1) != _labels(c, 1)


def test_order_of_an_epoch_does_not_depend_on_what_was_read_before():
    x, y = _xy()
    fresh = fl.data.arrays(x, np.arange(N), batch_size=8, seed=5)
    used = fl.data.arrays(x, np.arange(N), batch_size=8, seed=5)
    for epoch in (0, 1, 2):
        list(used.iter_epoch(epoch))
    next(iter(used.iter_epoch(7)))  # a partly read epoch
    assert _labels(used, 4) == _labels(fresh, 4)


def test_iter_is_epoch_zero_and_no_shuffle_is_the_identity():
    x, y = _xy()
    source = fl.data.arrays(x, np.arange(N), batch_size=8, seed=2)
    assert [yb.tolist() for _, yb in source] == _labels(source, 0)
    plain = fl.data.arrays(x, np.arange(N), batch_size=8, shuffle=False)
    assert _labels(plain, 3) == np.arange(N).reshape(-1, 8).tolist()


# --------------------------------------------------------------------- device=True
def test_device_indices_are_computed_in_jit_and_match_the_host_order():
    x, y = _xy()
    source = fl.data.arrays(x, np.arange(N), batch_size=8, seed=9, device=True)
    indices = jax.jit(source.epoch_indices)
    for epoch in (0, 3):
        on_device = indices(source.key_data, jnp.int32(epoch))
        assert on_device.dtype == jnp.int32 and on_device.shape == (len(source), 8)
        assert np.asarray(on_device).tolist() == _labels(source, epoch)
        from_seed = indices(np.uint32(9), jnp.int32(epoch))
        np.testing.assert_array_equal(from_seed, on_device)


@pytest.mark.parametrize("seed", [0, 2**31, 2**32 - 1])
def test_device_indices_from_a_python_seed_cover_the_whole_seed_range(seed):
    x, y = _xy()
    source = fl.data.arrays(x, np.arange(N), batch_size=8, seed=seed, device=True)
    in_jit = jax.jit(lambda epoch: source.epoch_indices(source.seed, epoch))(jnp.int32(1))
    assert np.asarray(in_jit).tolist() == _labels(source, 1)
    assert np.asarray(in_jit).ravel().tolist() == _expected_order(seed, 1, N).tolist()


def test_device_indices_take_a_typed_key_and_refuse_what_is_no_key_or_epoch():
    x, _ = _xy()
    source = fl.data.arrays(x, np.arange(N), batch_size=8, seed=5)
    expected = np.asarray(source.epoch_indices(5, 2))
    np.testing.assert_array_equal(source.epoch_indices(jax.random.key(5), 2), expected)
    np.testing.assert_array_equal(jax.jit(source.epoch_indices)(jax.random.key(5), 2), expected)
    raw = [int(k) for k in np.asarray(jax.random.PRNGKey(5))]  # key data written out
    np.testing.assert_array_equal(source.epoch_indices(raw, 2), expected)
    for bad in ("5", 5.0, None, True, np.zeros(3, np.float32)):
        with pytest.raises(TypeError, match=r"key_data_or_seed=.* must be a key \(key_data\)"):
            source.epoch_indices(bad, 2)
    for bad in (1.5, "2", None, np.float32(2), np.arange(2)):
        # an epoch of 1.5 was read as 1
        with pytest.raises(TypeError, match=r"epoch=.* must be an epoch number"):
            source.epoch_indices(5, bad)


def test_device_arrays_are_transferred_once_and_gather_matches_host_batches():
    x, y = _xy()
    source = fl.data.arrays({"v": x}, y, batch_size=8, seed=1, device=True)
    assert source.resident and source.batch_size == 8 and source.num_batches == N // 8
    assert source.transfers_done == 0
    placed = source.device_arrays
    assert source.device_arrays is placed and source.transfers_done == 1
    assert isinstance(placed[0]["v"], jax.Array)
    gather = jax.jit(source.gather)
    index = source.epoch_indices(source.key_data, 2)
    for b, (xb, yb) in enumerate(source.iter_epoch(2)):
        gx, gy = gather(placed, index[b])
        np.testing.assert_array_equal(np.asarray(gx["v"]), xb["v"])
        np.testing.assert_array_equal(np.asarray(gy), yb)


def test_host_source_refuses_device_placement():
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=8)
    assert not source.resident
    with pytest.raises(ValueError, match="device=True"):
        _ = source.device_arrays


def test_device_placement_names_the_dtype_and_the_cast_for_numbers_held_as_objects():
    x, y = _xy()
    with pytest.raises(ValueError, match=r"x has dtype object, .*x\.astype\(np\.float32\)$"):
        fl.data.arrays(x.astype(object), y, batch_size=8, device=True).put()
    with pytest.raises(ValueError, match=r"y has dtype <U3, .*np\.unique\(y, return_inverse"):
        fl.data.arrays(x, np.array(["cat", "dog"])[y % 2], batch_size=8, device=True).put()


def test_strings_beside_the_targets_or_in_a_list_are_named_with_the_fix():
    # Ids kept in y, which a loss of the user's own never reads: JAX's bare TypeError; a
    # Python list of strings was called "a list of numbers", cast with np.float32.
    x, y = _xy()
    ids = np.array([f"img_{i}" for i in range(len(y))])
    loss = lambda y_true, y_pred: jnp.mean((y_pred[:, 0] - y_true["t"]) ** 2)  # noqa: E731
    loop = fl.trainer(fl.models.mlp([4, 1]), loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"y\['id'\] has dtype <U\d+, which no device holds"):
        loop.run(fl.data.arrays(x, {"t": y.astype(np.float32), "id": ids}, batch_size=8))
    listed = {"a": x, "ids": ids.tolist()}
    with pytest.raises(ValueError, match=r"x\['ids'\] is a Python list of strings, which no"):
        fl.data.arrays(listed, y, batch_size=8)
    with pytest.raises(ValueError, match=r"x\['ids'\] is a Python list of strings, which no"):
        loop.run([({"a": x[:8], "ids": ids[:8].tolist()}, {"t": y[:8]})])


def test_a_list_mixing_strings_and_numbers_is_named_as_such():
    # It was taken as a pytree of scalars: "y[0] is a scalar; every leaf ... needs a
    # leading (example) axis", which says nothing of the string.
    x, y = _xy()
    mixed = [1, "a"] * (len(y) // 2)
    said = r"y is a Python list of strings mixed with numbers \(e\.g\. 'a'\), which no"
    with pytest.raises(ValueError, match=said):
        fl.data.arrays(x, mixed, batch_size=8)
    loop = fl.trainer(
        fl.models.mlp([4, CLASSES]), "sparse_categorical_cross_entropy", optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match=said):
        loop.run([(x[:8], mixed[:8])])


# --------------------------------------------------------------------- in a run
def _loop():
    return fl.trainer(
        fl.models.mlp([4, CLASSES]), "sparse_categorical_cross_entropy", optax.sgd(0.1)
    ).metric("accuracy")


LOOP = _loop()  # shared so each program compiles once for the module


def _leaves(state) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(state.step_state)]


def _assert_same_run(a, b) -> None:
    for u, v in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)
    assert a.history == b.history


@pytest.mark.parametrize("fuse", [False, 4])
def test_a_resumed_run_sees_the_same_order_as_an_uninterrupted_one(fuse):
    x, y = _xy()
    whole = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=6), epochs=3, fuse=fuse)
    first = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=6), epochs=2, fuse=fuse)
    resumed = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=6), first, epochs=3, fuse=fuse)
    _assert_same_run(whole, resumed)
    # and the shuffle matters: another seed trains differently
    other = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=7), epochs=3, fuse=fuse)
    assert any(
        not np.array_equal(u, v) for u, v in zip(_leaves(whole), _leaves(other), strict=True)
    )


def test_reusing_a_source_in_another_run_repeats_its_orders():
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=8, seed=6)
    _assert_same_run(LOOP.run(source, epochs=2, fuse=4), LOOP.run(source, epochs=2, fuse=4))


def test_an_epoch_runs_the_same_batches_as_a_list_of_that_epochs_batches():
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=8, seed=2)
    epoch0 = list(source.iter_epoch(0))
    _assert_same_run(LOOP.run(source, fuse=4), LOOP.run(epoch0, fuse=4))


@pytest.mark.parametrize("fuse", [False, 4])
def test_device_resident_source_is_bitwise_equal_to_the_host_source(fuse):
    x, y = _xy()
    host = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=3), epochs=3, fuse=fuse)
    device = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=3, device=True), epochs=3, fuse=fuse)
    _assert_same_run(host, device)


def test_device_resident_source_with_an_iteration_bound_is_bitwise_equal():
    x, y = _xy()
    kwargs = dict(epochs=2, iterations=5, fuse=4)
    host = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=3), **kwargs)
    device = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=3, device=True), **kwargs)
    _assert_same_run(host, device)
    assert int(device.step_state["step"]) == 10


def test_device_resident_fused_epochs_make_no_host_to_device_transfer():
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=8, seed=3, device=True)
    state = LOOP.run(source, epochs=3, fuse=4)
    # The dataset moves once; epochs gather their chunks on the device.
    assert state.stats["h2d_transfers"] == 1
    assert int(state.step_state["step"]) == 3 * len(source)
    host = LOOP.run(fl.data.arrays(x, y, batch_size=8, seed=3), epochs=3, fuse=4)
    assert host.stats["h2d_transfers"] > 1  # the counter does count chunk transfers


def test_device_resident_source_resumes_with_the_same_order():
    x, y = _xy()
    make = lambda: fl.data.arrays(x, y, batch_size=8, seed=8, device=True)  # noqa: E731
    whole = LOOP.run(make(), epochs=3, fuse=4)
    first = LOOP.run(make(), epochs=1, fuse=4)
    _assert_same_run(whole, LOOP.run(make(), first, epochs=3, fuse=4))


def test_a_resident_sources_first_batch_is_read_once_and_reused_by_later_runs():
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=8, seed=4, device=True)
    first = LOOP.run(source, epochs=2, fuse=4)
    again = LOOP.run(source, epochs=2, fuse=4)
    _assert_same_run(first, again)
    # The second run reads nothing for its first batch: one host sync fewer.
    assert again.stats["host_syncs"] == first.stats["host_syncs"] - 1
    (batch,) = source.first_batches.values()
    np.testing.assert_array_equal(batch[0], next(iter(source.iter_epoch(0)))[0])
    assert not batch[0].flags.writeable
    # A run resumed at epoch 2 reads (and keeps) that epoch's first batch.
    resumed = LOOP.run(source, first, epochs=3, fuse=4)
    assert sorted(key[0] for key in source.first_batches) == [0, 2] and resumed.epoch == 2


def _count_label_reads(monkeypatch) -> list[int]:
    """Counts every range check of labels (a first batch, a chunk, a batch, a dataset)."""
    from fuseloop import _label_rule

    reads: list[int] = []
    for name in ("check", "holds"):
        real = getattr(_label_rule.LabelRule, name)

        def counted(self, labels, *args, _real=real):
            reads.append(int(np.size(labels)))
            return _real(self, labels, *args)

        monkeypatch.setattr(_label_rule.LabelRule, name, counted)
    return reads


@pytest.mark.parametrize(("device", "fuse"), [(True, 4), (True, False), (False, 4), (False, False)])
def test_a_sources_labels_are_read_once_for_a_loss_and_vouch_for_its_batches(
    monkeypatch, device, fuse
):
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=8, seed=4, device=device)
    reads = _count_label_reads(monkeypatch)
    first = LOOP.run(source, epochs=2, fuse=fuse)
    # The first batch's labels (so a bad one there is named as such), then the whole
    # dataset's, once: no later batch or chunk of it is read again.
    assert reads == [8, N]
    again = LOOP.run(source, epochs=2, fuse=fuse)
    assert reads == [8, N]  # a later run reads nothing: the source keeps its verdict
    _assert_same_run(first, again)
    assert len(source.labels_checked) == 1


def test_the_labels_verdict_is_per_loss_so_a_narrower_model_is_still_refused():
    x, _ = _xy()
    y = np.arange(N, dtype=np.int32) % 3
    source = fl.data.arrays(x, y, batch_size=8, device=True)
    wide = fl.trainer(fl.models.mlp([4, 3]), "sparse_categorical_cross_entropy", "sgd")
    assert wide.run(source, fuse=4).status == "completed"
    narrow = fl.trainer(fl.models.mlp([4, 2]), "sparse_categorical_cross_entropy", "sgd")
    for _ in range(2):  # refused on every run: a failed check vouches for nothing
        with pytest.raises(ValueError, match=r"y holds the label 2.*2 classes"):
            narrow.run(source, fuse=4)


def test_a_sources_labels_are_read_only_so_its_verdict_cannot_go_stale():
    x, y = _xy()
    source = fl.data.arrays(x, y, batch_size=8)
    with pytest.raises(ValueError, match="read-only"):
        source.y[0] = 5
    _, yb = next(iter(source))
    yb[0] = y[0] + 5  # a batch is the caller's own, writable copy
    assert next(iter(source))[1][0] == y[0]


@pytest.mark.parametrize("fuse", [True, "run"])
def test_a_loop_reused_over_many_device_sources_keeps_none_of_them_alive(fuse):
    import gc
    import weakref

    x, y = _xy()
    gone = []
    gc.disable()  # a cycle would keep a source alive until the next collection
    try:
        for seed in range(3):  # a seed sweep: each seed's order program stays cached
            source = fl.data.arrays(x, y, batch_size=8, seed=seed, device=True)
            LOOP.run(source, epochs=2, fuse=fuse)
            gone.append(weakref.ref(source))
            del source
        assert [ref() for ref in gone] == [None, None, None]
    finally:
        gc.enable()


# --------------------------------------------------------------------- host orders
@pytest.mark.parametrize("n", [1, 2, 37, 1625, 1626, 4099])  # one round of keys to 1625, then 2
def test_the_host_order_is_jaxs_permutation_for_any_size(n):
    """The host sorts JAX's keys itself (XLA's sort is slow on a CPU): the same order."""
    source = fl.data.arrays(np.zeros((n, 1), np.float32), np.zeros(n, np.int32), 1, seed=5)
    for epoch in (0, 7):
        order = source.order(epoch)
        assert order.dtype == np.int32
        np.testing.assert_array_equal(order, _expected_order(5, epoch, n))


def test_where_the_hosts_sort_would_differ_the_host_takes_jaxs_permutation(monkeypatch):
    from fuseloop import _epoch_order

    n = 1033  # a size no other test uses, so its verdict is made here (the host sorts)
    monkeypatch.setattr(_epoch_order, "_AGREES", {})
    reversed_keys = lambda size: lambda key, epoch: -jnp.arange(size, dtype=jnp.uint32)[None]  # noqa: E731
    monkeypatch.setattr(_epoch_order, "_sort_keys", reversed_keys)  # keys JAX would not draw
    source = fl.data.arrays(np.zeros((n, 1), np.float32), np.zeros(n, np.int32), 1, seed=2)
    for epoch in (0, 1):
        np.testing.assert_array_equal(source.order(epoch), _expected_order(2, epoch, n))
    assert list(_epoch_order._AGREES.values()) == [False]
