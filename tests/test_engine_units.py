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
            "scale": jnp.asarray(1024.0),  # weakly typed: it must come back so
        },
        {"acc": {"loss": {"sum": jnp.float32(2.5), "count": jnp.float32(4.0)}}},
    )
    expected = jax.tree.map(lambda a: a, carry)
    back = programs.unpack(programs.pack(carry), carry)
    assert jax.tree.structure(back) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert getattr(a, "weak_type", False) == getattr(b, "weak_type", False)
    assert jnp.array_equal(
        jax.random.key_data(back[0]["key"]), jax.random.key_data(expected[0]["key"])
    )
    del back[0]["key"], expected[0]["key"]
    assert_tree_equal(back, expected)
    assert np.asarray(back[0]["w"]).tobytes() == np.arange(6.0, dtype=np.float32).tobytes()


def test_host_reads_give_what_device_get_gives() -> None:
    """`HostReads.get` reads leaves as views on a CPU; the values, dtypes, shapes and
    types are device_get's, bf16 and integer records and typed keys included."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fuseloop.engine.host import HostReads

    tree = {
        "records": {
            "loss": {"sum": jnp.arange(4, dtype=jnp.bfloat16) / 3, "count": jnp.ones(4)},
            "hits": {"sum": jnp.arange(4, dtype=jnp.int32), "count": jnp.arange(4.0)},
        },
        "n_run": jnp.int32(3),
        "flag": jnp.bool_(True),
        "key": jax.random.key(1),
        "host": np.arange(3),
        "scalar": np.float32(2.5),
        "plain": 7,
        "none": None,
    }
    stats = {"host_syncs": 0}
    got = HostReads(stats, ()).get(tree)
    expected = jax.device_get(tree)
    assert stats["host_syncs"] == 1
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    got_key, expected_key = got.pop("key"), expected.pop("key")
    assert np.array_equal(jax.random.key_data(got_key), jax.random.key_data(expected_key))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert type(a) is type(b)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()
        else:
            assert a == b
    assert not got["records"]["loss"]["sum"].flags.writeable  # read-only, as device_get's


def test_the_shared_epoch_counter_is_never_consumed() -> None:
    """Resident runs start their device epoch counter from one shared array per epoch;
    no program may donate it, so it still holds its epoch after runs (and a resume)."""
    import numpy as np

    import fuseloop as fl
    from conftest import trainer
    from fuseloop.engine.feeds import epoch_counter

    start = epoch_counter(0)
    assert epoch_counter(0) is start and int(epoch_counter(2)) == 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype(np.float32)
    y = rng.integers(0, 2, 32).astype(np.int32)
    data = fl.data.arrays(x, y, batch_size=4, device=True)
    loop = trainer()
    first = loop.run(data, epochs=2, fuse=3)
    again = loop.run(data, epochs=2, fuse=3)
    resumed = loop.run(data, first, epochs=3, fuse=3)
    assert int(start) == 0 and int(epoch_counter(2)) == 2 and not start.is_deleted()
    assert first.history == again.history and sorted(resumed.history) == [0, 1, 2]


def test_the_looped_trainer_init_is_the_plain_program_init() -> None:
    """On a CPU a small trainer init runs as one program with its work in a loop of one
    trip (engine/start.py); every leaf is the plain program's, bit for bit, for given and
    for fresh variables, and the program is made once per variables' signature."""
    import jax

    from conftest import assert_tree_equal, make_batches, tiny_mlp, trainer
    from fuseloop.engine.programs import Programs
    from fuseloop.engine.start import InlineInit, _trainer_init

    loop = trainer()
    first = make_batches(1)[0]
    init = _trainer_init(Programs(loop), first)
    assert isinstance(init, InlineInit)  # the suite runs on a CPU
    variables = tiny_mlp().init(jax.random.PRNGKey(5), first[0])
    for given in (variables, None):
        looped, signature, _ = init.start(given, first)
        plain = jax.jit(init.init)(given, None)  # an MLP's init reads x's shapes only
        leaves, treedef = jax.tree.flatten(looped)
        assert signature == (treedef, tuple((a.shape, a.dtype) for a in leaves))
        assert_tree_equal(looped, plain, "initial step state")
        structure = jax.tree.structure(given)
        (program,) = [p for k, (_, _, p, _, _) in init.programs.items() if k[0] == structure]
        assert "while" in program.lower(given, None, 1).as_text()
    programs = len(init.programs)
    init.start(variables, first)
    assert len(init.programs) == programs


def test_a_large_step_state_is_initialized_by_the_plain_program(monkeypatch) -> None:
    """Over `LOOP_BYTES` the init is the plain program (no loop): its copies may then use
    XLA's threads."""
    import jax.numpy as jnp

    from fuseloop.engine.start import InlineInit

    def init(variables, batch):
        return {f"w{i}": jnp.full((40,), i, jnp.float32) + variables for i in range(40)}

    for limit, looped in ((40 * 40 * 4, True), (40 * 40 * 4 - 1, False)):
        monkeypatch.setattr(InlineInit, "LOOP_BYTES", limit)
        inline = InlineInit(init)
        out, _, _ = inline.start(jnp.float32(1.0))
        ((_, _, program, _, small),) = inline.programs.values()
        assert ("while" in program.lower(jnp.float32(1.0), None, 1).as_text()) is looped
        assert small is looped  # only a small state is looped (and kept as a spare)
        assert [float(out[f"w{i}"][0]) for i in range(40)] == [i + 1.0 for i in range(40)]


def test_seed_keys_are_the_split_of_the_seed() -> None:
    import jax
    import numpy as np

    from fuseloop._epoch_order import prng_config
    from fuseloop._step import _seed_keys

    for seed in (0, 7, 2**31 - 1):
        expected = np.asarray(jax.random.split(jax.random.PRNGKey(seed)))
        init_key, dropout_key = _seed_keys(seed, prng_config(), False)
        assert init_key.tobytes() == expected[0].tobytes()
        assert dropout_key.tobytes() == expected[1].tobytes()


def test_stack_chunk_lays_each_batch_in_its_slot() -> None:
    """`stack_chunk` writes batches end to end (engine/feeds' one copy per leaf): the slots
    are `np.stack`'s for strided views, scalar leaves and list leaves, zero-padded."""
    import jax
    import numpy as np

    from fuseloop._fusion import stack_chunk

    rng = np.random.default_rng(0)
    strided = [(rng.normal(size=(6, 4)).astype(np.float32).T, np.int32(i)) for i in range(3)]
    listed = [([1.0, 2.0], {"w": rng.normal(size=(2, 2))}) for _ in range(3)]
    for batches in (strided, listed):
        stacked = stack_chunk(batches, 5, 0)
        for got, leaves in zip(
            jax.tree.leaves(stacked), zip(*map(jax.tree.leaves, batches), strict=True), strict=True
        ):
            assert got.shape[0] == 5
            np.testing.assert_array_equal(got[:3], np.stack([np.asarray(a) for a in leaves]))
            assert not got[3:].any()


def test_labels_below_reads_signed_labels_as_unsigned() -> None:
    """One reduction decides the range check (a negative label, read as unsigned, is above
    any class count) for every integer width, strided labels and floats alike."""
    import numpy as np

    from fuseloop._label_rule import labels_below

    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.float32):
        labels = (np.arange(40, dtype=dtype).reshape(4, 10) % 7)[:, ::2]
        top = int(labels.max())
        assert labels_below(labels, top + 1) and not labels_below(labels, top)
        if np.dtype(dtype).kind != "u":
            negative = labels.copy()
            negative[1, 1] = -1
            assert not labels_below(negative, 100)


def test_device_signature_follows_the_64_bit_mode() -> None:
    """Canonical dtypes are remembered per 64-bit mode: float64 host leaves are float32 on
    the device while the mode is off, float64 while it is on."""
    import jax
    import numpy as np

    from fuseloop._placement import device_signature

    tree = {"x": np.ones((2, 3)), "n": 3, "k": jax.random.key(0)}
    _, off = device_signature(tree)
    with jax.enable_x64(True):
        _, on = device_signature(tree)
    _, off_again = device_signature(tree)
    assert off == off_again
    # Leaves in key order: k (a typed key, kept as it is), n, x.
    assert [dtype for _, dtype in off][1:] == [np.dtype("int32"), np.dtype("float32")]
    assert [dtype for _, dtype in on][1:] == [np.dtype("int64"), np.dtype("float64")]
    assert off[0][1] == on[0][1] == jax.random.key(0).dtype
    assert [shape for shape, _ in on] == [(), (), (2, 3)]


def test_a_chunk_launch_enters_the_transfer_guard_context_only_under_a_guard() -> None:
    """Without a host-to-device guard nothing needs allowing; under one, the chunk's own
    transfer is allowed (and a fused run under `disallow` still trains)."""
    import contextlib

    import jax

    from conftest import make_batches, trainer
    from fuseloop._placement import Placement
    from fuseloop._state import new_stats

    placement = Placement(None, new_stats())
    assert isinstance(placement.chunk_transfer(), contextlib.nullcontext)
    with jax.transfer_guard_host_to_device("disallow"):
        assert not isinstance(placement.chunk_transfer(), contextlib.nullcontext)
        state = trainer().run(make_batches(4), fuse=2)
    assert state.stats["h2d_transfers"] == 2


def test_a_fresh_init_keeps_a_spare_unless_it_reads_the_batchs_values() -> None:
    """A fresh init whose values depend on no batch value (a model's forward pass on x
    feeds no parameter) is made again ahead for the next run; one that reads them (an
    ActNorm's statistics) is not: the next run's first batch may differ."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fuseloop.engine.init_batch import abstract_batch, reads_any
    from fuseloop.engine.start import InlineInit

    def shapes_only(variables, batch):
        batch = jnp.zeros((4, 3)) if batch is None else batch  # as _trainer_init's does
        batch @ jnp.ones((3, 2))  # a forward pass whose result no output reads
        return {"w": jnp.ones((batch.shape[1], 2))}

    def from_values(variables, batch):
        return {"w": jnp.ones((batch.shape[1], 2)) * batch.mean()}

    first = np.ones((4, 3), np.float32)
    shapes = abstract_batch(jax.tree.structure(first), (((4, 3), np.dtype(np.float32)),))
    for init, spares in ((shapes_only, True), (from_values, False)):
        _, _, spare_maker = InlineInit(init, True, shapes).start(None, first)
        assert (spare_maker is not None) is spares, init.__name__
        traced = jax.make_jaxpr(init)(None, first)
        assert reads_any(traced.jaxpr, traced.jaxpr.invars) is not spares


def test_whether_an_init_reads_x_is_told_through_nested_programs() -> None:
    """nn.scan's layers and nn.remat run the forward pass inside a nested program whose
    outputs hold the parameters too: taken as a whole, an ordinary stack of layers read
    as data-dependent (no spare; refused under several processes). A statistic of x
    initialised inside the scan, or behind stop_gradient, is still found."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from fuseloop.engine.init_batch import reads_any

    class Layer(nn.Module):
        from_data: bool

        @nn.compact
        def __call__(self, carry, _):
            if self.from_data:
                scale = self.param("s", lambda rng: jax.lax.stop_gradient(1 / carry.std()))
                carry = carry * scale
            return nn.Dense(4)(carry), None

    class Stack(nn.Module):
        from_data: bool

        @nn.compact
        def __call__(self, x):
            layers = nn.scan(
                Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            return nn.remat(nn.Dense)(3)(layers(self.from_data)(x, None)[0])

    for from_data in (False, True):
        model = Stack(from_data)
        traced = jax.make_jaxpr(model.init)(jax.random.PRNGKey(0), jnp.ones((2, 4)))
        assert reads_any(traced.jaxpr, traced.jaxpr.invars[1:]) is from_data

    def through_the_carry(x):  # each step's output reads the carry, which sums x
        return jax.lax.scan(lambda c, _: (c + x.mean(), c * 2), 0.0, None, length=3)[1]

    traced = jax.make_jaxpr(through_the_carry)(jnp.ones(4))
    assert reads_any(traced.jaxpr, traced.jaxpr.invars)

    class Branchy(nn.Module):  # nn.cond on a constant, a debug print of x: no read
        @nn.compact
        def __call__(self, x):
            jax.debug.print("mean {}", x.mean())
            return nn.cond(True, lambda m, x: m(x) * 2, lambda m, x: m(x), nn.Dense(1), x)

    traced = jax.make_jaxpr(Branchy().init)(jax.random.PRNGKey(0), jnp.ones((2, 4)))
    assert not reads_any(traced.jaxpr, traced.jaxpr.invars[1:])

    def chosen_by_x(x):  # a branch taken on x's values reads them
        return jax.lax.cond(x.sum() > 0, lambda: jnp.ones(2), lambda: jnp.zeros(2))

    traced = jax.make_jaxpr(chosen_by_x)(jnp.ones(4))
    assert reads_any(traced.jaxpr, traced.jaxpr.invars)

    def through_a_ref(x):  # a ref written with x's mean (an effect), read into the output
        ref = jax.new_ref(jnp.zeros(()))
        ref[...] = x.mean()
        return ref[...] * jnp.ones(2)

    traced = jax.make_jaxpr(through_a_ref)(jnp.ones(4))
    assert reads_any(traced.jaxpr, traced.jaxpr.invars)


def test_a_data_dependent_init_under_several_processes_is_refused_with_the_fix(monkeypatch):
    """Each process holds only its rows of the first batch: an init from them would differ
    between processes, so it is refused, naming the fix (pass the variables)."""
    import numpy as np
    import pytest

    from fuseloop.engine import init_batch

    first = (np.ones((4, 3), np.float32), np.zeros(4, np.int32))
    assert init_batch.batch_values(first)[0].shape == (4, 3)  # one process: the batch
    monkeypatch.setattr(init_batch, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"reads the first batch's values.*run\(data, model"):
        init_batch.batch_values(first)


def test_an_epoch_pieces_slots_follow_the_bound_only_where_its_records_come_back():
    # Without records every bound takes one program (the whole epoch's slots, the bound an
    # input); with them the host reads every slot back, so the slots follow the bound
    # (rounded up to a power of two) and not a large epoch's length.
    import numpy as np

    import fuseloop as fl
    from fuseloop.engine.whole_program import piece_steps

    x = np.zeros((2000, 1), np.float32)
    source = fl.data.arrays(x, np.zeros(2000, np.int32), batch_size=2)  # 1000 batches
    assert {piece_steps(source, bound, False) for bound in (1, 3, 1000)} == {1000}
    assert [piece_steps(source, bound, True) for bound in (1, 3, 5, 600, 1000)] == [
        2,
        4,
        8,
        1000,
        1000,
    ]
