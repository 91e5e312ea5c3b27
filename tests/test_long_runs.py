"""Long runs do not accumulate: device arrays, host memory, compiled programs and threads
stay flat over hundreds of epochs and repeated runs (docs/reliability.md)."""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseloop as fl
from conftest import counter_init, counter_loop, make_batches, tiny_mlp
from fuseloop import _optim, _placement

SPARSE = "sparse_categorical_cross_entropy"
EPOCHS = 300
SAMPLED = (50, 150, EPOCHS - 1)
# History, times and epoch_time gain one small entry per epoch by design (well under 1 KB);
# a leaked chunk of the batches below would be >= 8 KB an epoch.
BYTES_PER_EPOCH = 2048


class CompileCounter:
    """Counts XLA backend compiles while enabled (a process-wide jax.monitoring listener)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.enabled, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if self.enabled and event == self.EVENT:
            self.count += 1

    def __enter__(self) -> CompileCounter:
        self.enabled, self.count = True, 0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.enabled = False


COMPILES = CompileCounter()


def wide_batches(n: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(16, 64)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32))
        for _ in range(n)
    ]


class Sampler:
    """At a few epochs: the number of live device arrays and the traced host memory."""

    def __init__(self) -> None:
        self.samples: dict[int, tuple[int, int]] = {}

    def __call__(self, state: fl.State) -> None:
        if state.epoch in SAMPLED:
            gc.collect()
            self.samples[state.epoch] = (len(jax.live_arrays()), tracemalloc.get_traced_memory()[0])


@pytest.mark.parametrize("fuse", [2, False])
def test_device_arrays_and_host_memory_stay_flat_over_hundreds_of_epochs(fuse):
    sampler = Sampler()
    loop = (
        fl.trainer(tiny_mlp(), SPARSE, "adam")
        .metric("accuracy")
        .handle_event("epoch_completed", sampler)
    )
    data = wide_batches()
    loop.run(data, epochs=2, fuse=fuse)  # compile outside the measured run
    tracemalloc.start()
    try:
        state = loop.run(data, epochs=EPOCHS, fuse=fuse)
    finally:
        tracemalloc.stop()
    assert state.status == "completed" and len(state.history) == EPOCHS
    first, *_, last = (sampler.samples[e] for e in SAMPLED)
    assert [s[0] for s in sampler.samples.values()] == [first[0]] * len(SAMPLED)
    grown = last[1] - first[1]
    assert grown < BYTES_PER_EPOCH * (SAMPLED[-1] - SAMPLED[0]), f"{grown} bytes"


def test_repeated_runs_leave_no_device_arrays_behind():
    loop = fl.trainer(tiny_mlp(), SPARSE, "adam")
    data = make_batches(4)

    def live_after_run(fuse: Any) -> int:
        state = loop.run(data, epochs=1, fuse=fuse)
        del state
        gc.collect()
        return len(jax.live_arrays())

    for fuse in (False, 2):
        baseline = live_after_run(fuse)
        assert [live_after_run(fuse) for _ in range(3)] == [baseline] * 3


def _scaled_sgd(scale: jax.Array) -> optax.GradientTransformation:
    """SGD whose updates read a device array the optimizer closes over."""
    return optax.chain(
        optax.scale(-0.1), optax.stateless(lambda g, p: jax.tree.map(lambda t: t * scale[0], g))
    )


def test_a_finished_trainer_keeps_no_optimizer_alive():
    """An optimizer closing over a device array (a preconditioner, a mask) stayed alive,
    array and all, in a cache of the last 64 optimizers after its Loop and State were gone."""
    tx = _scaled_sgd(jnp.full((1000,), 0.5))
    loop = fl.trainer(tiny_mlp(), SPARSE, tx)
    loop.run(make_batches(2), epochs=1)
    kept = weakref.ref(tx.init)
    del loop, tx
    gc.collect()
    assert kept() is None
    # An optimizer object with an init method (a new bound method at each read) is asked
    # afresh each time: the object may have changed (a wrapper whose inner optimizer the
    # user swapped after a refusal), and two of its methods are two optimizers.
    traced: list[int] = []

    class Own:
        def init(self, params: Any) -> Any:
            traced.append(1)
            return {"m": jax.tree.map(jnp.zeros_like, params)}

    own = Own()
    assert [_optim.abstract_state(own) for _ in range(3)][0] is not None and traced == [1] * 3
    kept = weakref.ref(own)
    del own
    gc.collect()
    assert kept() is None


def test_a_run_resumed_epoch_after_epoch_on_resident_data_keeps_a_bounded_set(monkeypatch):
    # A notebook's `state = loop.run(data, state, epochs=k + 1)`: each resume starts at a
    # new epoch. Its first batch (a host copy holding device buffers on CPU) and its epoch
    # number's device scalar were kept per epoch, without bound (+3 arrays a resume).
    monkeypatch.setattr(_placement, "_KEPT_CONSTANTS", 8)
    # Earlier tests' constants would be let go one by one as this test's arrive, and the
    # live count fall with them: the count is this test's own from an empty set.
    monkeypatch.setattr(_placement, "_DEVICE_INTS", OrderedDict())
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)
    data = fl.data.arrays(x, y, batch_size=32, device=True)
    loop = fl.trainer(tiny_mlp(), SPARSE, "sgd")
    state, live = None, []
    for epoch in range(24):
        state = loop.run(data, state, epochs=epoch + 1, fuse=4)
        if epoch >= 16:
            gc.collect()
            live.append(len(jax.live_arrays()))
    assert live == [live[0]] * len(live), live
    assert len(data.first_batches) <= 4


# --------------------------------------------------------------------------- compiles
@pytest.mark.parametrize("fuse", [False, 1, 4])
def test_a_second_run_of_the_same_loop_compiles_nothing(fuse):
    loop = (
        fl.trainer(tiny_mlp(), SPARSE, "adam")
        .metric("accuracy")
        .handle_event("iteration_completed", lambda s: None, {"every": 3})
        .terminate_on_nan()
    )
    first = loop.run(make_batches(6), epochs=2, fuse=fuse)
    assert first.stats["compiles"] >= 1
    loop.run(make_batches(6), first, epochs=3, fuse=fuse)  # the first resume may compile a copy
    with COMPILES:
        again = loop.run(make_batches(6, seed=1), epochs=2, fuse=fuse)
        resumed = loop.run(make_batches(6), again, epochs=3, fuse=fuse)
    assert again.stats["compiles"] == resumed.stats["compiles"] == 0
    assert COMPILES.count == 0, "XLA compiled during a repeated run"
    assert int(resumed.step_state["step"]) == 18


def test_evaluator_and_custom_loops_do_not_recompile():
    params = fl.trainer(tiny_mlp(), SPARSE, "adam").run(make_batches(2)).params
    evaluator = fl.evaluator(tiny_mlp()).metric("accuracy")
    custom = counter_loop()
    for fuse in (False, 4):
        evaluator.run(make_batches(4), params, fuse=fuse)
        custom.run(make_batches(4), counter_init(), fuse=fuse)
        with COMPILES:
            assert evaluator.run(make_batches(4), params, fuse=fuse).stats["compiles"] == 0
            assert custom.run(make_batches(4), counter_init(), fuse=fuse).stats["compiles"] == 0
        assert COMPILES.count == 0


# --------------------------------------------------------------------------- threads
def threads() -> set[int]:
    return {t.ident for t in threading.enumerate()}


def no_thread_beyond(before: set[int], seconds: float = 10.0) -> bool:
    """Whether the threads alive are among `before`, waiting up to `seconds` for extra ones
    to end: orbax's save runs on a shared asyncio executor, whose pool may start a worker
    for a save and let it end just after (a loaded machine caught one still running); a
    thread the run kept does not end."""
    deadline = time.monotonic() + seconds
    while not threads() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads() <= before


class Boom(Exception):
    pass


def generated(n: int, fail_at: int | None = None) -> Any:
    """A callable source (re-iterable: the fused loop may prepare chunks in a thread)."""

    def epoch() -> Iterator[Any]:
        for i, batch in enumerate(make_batches(n)):
            if i == fail_at:
                raise Boom("bad record")
            yield batch

    return epoch


def test_an_asynchronous_checkpoint_leaves_no_thread_behind_its_run(tmp_path):
    """Orbax's manager kept a thread per Loop until the Loop's next run or its collection:
    a notebook that keeps its loops gathered one a run."""
    loops = [counter_loop().checkpoint(tmp_path / str(i), asynchronous=True) for i in range(3)]
    # The first asynchronous save of the process starts orbax's own shared threads.
    loops[0].run(make_batches(2), counter_init(), epochs=2)
    before = threads()
    for loop in loops[1:]:  # an earlier test's threads may end meanwhile: none is added
        loop.run(make_batches(2), counter_init(), epochs=2)
        assert no_thread_beyond(before)
    halting = loops[0].handle_event("epoch_completed", lambda s: "halt_loop")
    assert halting.run(make_batches(2), counter_init(), epochs=3).status == "halted"
    assert no_thread_beyond(before)


@pytest.mark.parametrize("fuse", [False, 2])
def test_no_threads_left_behind(fuse):
    loop = counter_loop()
    before = threads()
    loop.run(generated(8), counter_init(), epochs=2, fuse=fuse)
    assert threads() == before
    halting = loop.handle_event("epoch_completed", lambda s: "halt_loop")
    assert halting.run(generated(8), counter_init(), epochs=3, fuse=fuse).status == "halted"
    assert threads() == before
    with pytest.raises(Boom):
        loop.run(generated(8, fail_at=5), counter_init(), fuse=fuse)
    assert threads() == before
    with pytest.raises(ValueError):  # a bad batch in the middle of an epoch
        loop.run([*make_batches(3), (np.zeros((2, 2)), None)], counter_init(), fuse=fuse)
    assert threads() == before
