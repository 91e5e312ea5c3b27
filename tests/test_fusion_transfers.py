"""Host syncs and transfers of the fused loop: one dispatch
and one transfer per chunk, at most one host sync per chunk plus one per epoch, and no
hidden host<->device transfer inside the fused region (checked with JAX's transfer
guards: the loop's explicit `device_put`/`device_get` are allowed, implicit ones are not)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import assert_runs_identical, make_batches, tiny_mlp, trainer

DATA = make_batches(100)
LOOP = trainer(optimizer="sgd").metric("accuracy")


def chunks(n_batches: int, k: int) -> int:
    return -(-n_batches // k)


@pytest.mark.parametrize("fuse,k", [(32, 32), (True, 32), (7, 7)])
def test_one_dispatch_and_one_transfer_per_chunk(fuse, k):
    state = LOOP.run(DATA, epochs=2, fuse=fuse)
    per_epoch = chunks(100, k)
    assert state.stats["chunk_size"] == k
    assert state.stats["dispatches"] == 2 * per_epoch
    assert state.stats["h2d_transfers"] == 2 * per_epoch
    assert state.stats["host_syncs"] <= 2 * per_epoch + 2


def test_fuse_32_over_100_batches_is_4_dispatches_an_epoch():
    state = LOOP.run(DATA, epochs=3, fuse=32)
    assert state.stats["dispatches"] == 12
    assert state.stats["host_syncs"] <= 12 + 3


def test_host_syncs_with_an_iteration_handler_stay_per_chunk():
    fired: list = []
    loop = LOOP.handle_event(
        "iteration_completed", lambda s: fired.append(s.metrics), {"every": 10}
    )
    state = loop.run(DATA, epochs=2, fuse=32)
    assert len(fired) == 20
    assert state.stats["dispatches"] == 8
    assert state.stats["host_syncs"] <= 8 + 2


def test_unfused_host_syncs_do_not_scale_with_batches():
    state = LOOP.run(DATA, epochs=2)
    assert state.stats["dispatches"] == 200
    assert state.stats["host_syncs"] <= 2


# --------------------------------------------------------------------------- transfer guard
class Guard:
    """Enters JAX transfer guards at `epoch_started` and leaves them at `epoch_completed`,
    so the guarded region is the whole fused epoch: pulling, stacking, transferring and
    running chunks, replaying iteration events, and reading the epoch's metrics."""

    def __init__(self, device_to_host: bool):
        self.device_to_host = device_to_host
        self.stack = contextlib.ExitStack()
        self.entered = 0

    def enter(self, state: fl.State) -> None:
        self.stack.enter_context(jax.transfer_guard_host_to_device("disallow"))
        if self.device_to_host:
            self.stack.enter_context(jax.transfer_guard_device_to_host("disallow"))
        self.entered += 1

    def leave(self, state: fl.State) -> None:
        self.stack.close()


def guarded(loop: fl.Loop, guard: Guard) -> fl.Loop:
    """`loop` with the guard around each epoch (the base loops have no epoch handlers,
    so these are the first on epoch_started and the last on epoch_completed)."""
    return loop.handle_event("epoch_started", guard.enter).handle_event(
        "epoch_completed", guard.leave
    )


@pytest.mark.parametrize("device_to_host", [False, True], ids=["h2d", "h2d+d2h"])
@pytest.mark.parametrize(
    "with_iteration_handler", [False, True], ids=["no_handlers", "iteration_handler"]
)
def test_no_hidden_transfers_in_the_fused_region(device_to_host, with_iteration_handler):
    data = DATA[:30]
    loop = LOOP
    if with_iteration_handler:
        loop = loop.handle_event("iteration_completed", lambda s: None, {"every": 3})
    guard = Guard(device_to_host)
    try:
        state = guarded(loop, guard).run(data, epochs=2, fuse=8)
    finally:
        guard.stack.close()
    assert guard.entered == 2
    assert state.stats["dispatches"] == 2 * chunks(30, 8)
    # The guarded run computes exactly what an unguarded one does.
    assert_runs_identical(state, loop.run(data, epochs=2, fuse=8))


def test_the_guard_catches_an_implicit_transfer():
    """Control: the guarded region really rejects an implicit host-to-device transfer."""

    def implicit(state: fl.State) -> None:
        jnp.add(jnp.ones(2), np.ones(2, np.float32))  # numpy operand -> implicit transfer

    loop = LOOP.handle_event("iteration_completed", implicit, "first")
    guard = Guard(device_to_host=False)
    with pytest.raises(Exception, match="(?i)disallowed host-to-device"):
        try:
            guarded(loop, guard).run(DATA[:8], fuse=4)
        finally:
            guard.stack.close()


@pytest.mark.parametrize(
    "kind,fuse",
    [("list", False), ("list", 4), ("host", False), ("device", False), ("device", "run")],
)
def test_a_whole_run_under_a_host_to_device_guard_moves_only_its_batches(kind, fuse):
    """The guard around `run` itself, in a process that has made no key yet: the library's
    own keys and scalars are allowed, each step's or chunk's batches are its one transfer,
    and a resident epoch's order moves nothing (its seed's key is made on the device once)."""
    from fuseloop import _epoch_order, _placement

    _epoch_order._seed_key.cache_clear()
    _placement._DEVICE_INTS.clear()
    batches = make_batches(8)
    x, y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    data = {
        "list": batches,
        "host": fl.data.arrays(x, y, batch_size=4, seed=3),
        "device": fl.data.arrays(x, y, batch_size=4, seed=3, device=True),
    }[kind]
    expected = LOOP.run(data, epochs=2, fuse=fuse)
    _epoch_order._seed_key.cache_clear()
    _placement._DEVICE_INTS.clear()
    with jax.transfer_guard_host_to_device("disallow"):
        guarded = LOOP.run(data, epochs=2, fuse=fuse)
    assert_runs_identical(guarded, expected)


@pytest.mark.parametrize("fuse", [32, "run"])
def test_a_validated_whole_run_under_a_host_to_device_guard(fuse):
    # The whole run's epoch order was asked for with a numpy epoch number: JAX's own
    # "Disallowed host-to-device transfer" from inside the library.
    from fuseloop import _placement

    batches = make_batches(8)
    x, y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    loop = LOOP.validate(tiny_mlp(), fl.data.arrays(x, y, batch_size=4, shuffle=False))
    data = fl.data.arrays(x, y, batch_size=4, seed=3, device=True)
    expected = loop.run(data, epochs=2, fuse=fuse)
    _placement._DEVICE_INTS.clear()
    with jax.transfer_guard_host_to_device("disallow"):
        guarded = loop.run(
            fl.data.arrays(x, y, batch_size=4, seed=3, device=True), epochs=2, fuse=fuse
        )
    assert_runs_identical(guarded, expected)
