"""The JAX systems: the floor, the plain per-batch loop, the host-callback design, fuseloop.

Each system compiles and warms up in `setup()`; `sample(epochs)` then times that many
steady-state epochs (compilation excluded) and returns their times with what the guards need
to verify them. Several short epochs per sample make a sample of a tiny model long enough
to average over the scheduler's noise.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from ..engine import conv_layout
from ._guards import Refused, Skipped, devices_of
from ._workload import BenchWorkload

__all__ = ["Sample", "System", "Floor", "PlainLoop", "HostCallback", "Fuseloop"]


@dataclass
class Sample:
    """Timed epochs of one system.

    Attributes:
        seconds: Each epoch's wall time (steady state).
        devices: Where its inputs and outputs lay (see `_guards.devices_of`).
        outputs: Host values that must be finite (losses).
        params: Host copy of the final trainable parameters, for the agreement guards.
        info: Extra figures reported in the JSON (run wall time, counters).
    """

    seconds: list[float]
    devices: set[str]
    outputs: Any = None
    params: Any = None
    info: dict[str, Any] = field(default_factory=dict)


class System:
    """A way of training epochs of a workload.

    Attributes:
        intended: The device its arrays must be on (`str` of a JAX device).
        reference_params: Parameters after one epoch from the initial ones, for systems
            that others are checked against (fuseloop); None otherwise.
    """

    reference_params: Any = None

    def __init__(self, workload: BenchWorkload):
        self.w = workload
        self.intended = str(jax.devices()[0])

    def setup(self) -> None:
        """Compiles and runs one warm-up epoch; raises `Skipped` if it cannot run here."""
        self.sample(1)

    def sample(self, epochs: int) -> Sample:  # pragma: no cover - abstract
        raise NotImplementedError


class _FreshEpochs(System):
    """A system whose every epoch starts again from the initial parameters."""

    def epoch(self) -> tuple[float, Any, Any, Any]:
        """One timed epoch: `(seconds, params, losses, arrays to check the device of)`."""
        raise NotImplementedError  # pragma: no cover - abstract

    def sample(self, epochs: int) -> Sample:
        seconds = []
        for _ in range(epochs):
            elapsed, params, losses, arrays = self.epoch()
            seconds.append(elapsed)
        return Sample(
            seconds,
            devices_of(arrays),
            outputs=jax.device_get(losses),
            params=jax.device_get(params),
        )


def _block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


class Floor(_FreshEpochs):
    """`jax.jit(lax.scan(step))` over the whole epoch: what the hardware can do.

    With `transfer=True` the timing includes stacking the epoch's batches on the host and
    moving them to the device in one `device_put`. Its convolutions are lowered
    channel-last as fuseloop's are (docs/design.md §10): under XLA:CPU's own layout a
    convolution's gradient runs 10-25x slower inside a loop, which would measure that, not
    the hardware (`bench/conv_layout.py`).
    """

    def __init__(self, workload: BenchWorkload, transfer: bool):
        super().__init__(workload)
        self.transfer = transfer
        step = workload.train_step

        def epoch(params: Any, opt_state: Any, xs: Any, ys: Any) -> Any:
            def body(carry: Any, batch: Any) -> Any:
                params, opt_state, loss = step(*carry, *batch)
                return (params, opt_state), loss

            return lax.scan(body, (params, opt_state), (xs, ys))

        self.fn = jax.jit(conv_layout.named(epoch, "floor_epoch"), donate_argnums=(0, 1))
        self.resident = jax.device_put(workload.stacked())

    def epoch(self) -> tuple[float, Any, Any, Any]:
        params, opt_state = _block(self.w.fresh_state())
        began = time.perf_counter()
        data = jax.device_put(self.w.stacked()) if self.transfer else self.resident
        (params, opt_state), losses = self.fn(params, opt_state, *data)
        _block((params, opt_state, losses))
        seconds = time.perf_counter() - began
        return seconds, params, losses, (data, params, opt_state, losses)


class PlainLoop(_FreshEpochs):
    """What most JAX users write: a jitted step per batch, reading the loss every step."""

    def __init__(self, workload: BenchWorkload):
        super().__init__(workload)
        self.fn = jax.jit(workload.train_step, donate_argnums=(0, 1))

    def epoch(self) -> tuple[float, Any, Any, Any]:
        params, opt_state = _block(self.w.fresh_state())
        losses = []
        began = time.perf_counter()
        for x, y in self.w.batches:
            params, opt_state, loss = self.fn(params, opt_state, x, y)
            losses.append(float(loss))  # host sync, as a logging loop does
        _block(params)
        seconds = time.perf_counter() - began
        return seconds, params, np.array(losses), (params, opt_state, loss)


class HostCallback(_FreshEpochs):
    """The rejected design: a device loop that pulls each batch from the host through
    `jax.experimental.io_callback`."""

    def __init__(self, workload: BenchWorkload):
        super().__init__(workload)
        batches, step, n = workload.batches, workload.train_step, workload.n_batches
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])

        def fetch(i: Any) -> Any:
            return batches[int(i)]

        def epoch(params: Any, opt_state: Any) -> Any:
            def body(i: Any, carry: Any) -> Any:
                params, opt_state, losses = carry
                x, y = io_callback(fetch, shapes, i, ordered=False)
                params, opt_state, loss = step(params, opt_state, x, y)
                return params, opt_state, losses.at[i].set(loss)

            return lax.fori_loop(0, n, body, (params, opt_state, jnp.zeros(n, jnp.float32)))

        self.fn = jax.jit(epoch, donate_argnums=(0, 1))

    def epoch(self) -> tuple[float, Any, Any, Any]:
        params, opt_state = _block(self.w.fresh_state())
        began = time.perf_counter()
        params, opt_state, losses = _block(self.fn(params, opt_state))
        seconds = time.perf_counter() - began
        return seconds, params, losses, (params, opt_state, losses)


def resident_source_supported() -> bool:
    """Whether `fl.data.arrays` takes `device=True` in this fuseloop."""
    from .. import data

    arrays = getattr(data, "arrays", None)
    return arrays is not None and "device" in inspect.signature(arrays).parameters


class Fuseloop(System):
    """`fl.trainer(...).run(data, epochs=n + 1, fuse=...)`, timing epochs 1..n from
    `state.stats["epoch_time"]`: steady-state epochs inside a run. The run's first epoch and
    its one-off start-up are reported separately (`first_epoch_s`, `run_wall_s`)."""

    def __init__(self, workload: BenchWorkload, fuse: Any, resident: bool = False):
        super().__init__(workload)
        from .. import trainer

        self.fuse, self.resident = fuse, resident
        self.loop = trainer(workload.module, "sparse_categorical_cross_entropy", workload.tx)
        self.data: Any = workload.batches
        if resident:
            if not resident_source_supported():
                raise Skipped("fl.data.arrays(device=True) is not available in this fuseloop")
            from .. import data

            self.data = data.arrays(
                workload.x, workload.y, workload.batch_size, shuffle=False, device=True
            )

    def setup(self) -> None:
        # The warm-up run compiles; timed runs must then compile nothing.
        state = self.loop.run(self.data, self.w.variables, fuse=self.fuse)
        self.reference_params = jax.device_get(self.w.compared(state.step_state["params"]))

    def _expected_dispatches(self, epochs: int) -> int | None:
        n = self.w.n_batches
        if self.fuse is False:
            return n * epochs
        if self.resident and self.fuse != "auto" and self.fuse > n:
            return math.ceil(n * epochs / self.fuse)  # chunks cross epochs (resident data)
        return None if self.fuse == "auto" else math.ceil(n / self.fuse) * epochs

    def _verify(self, stats: dict[str, Any], epochs: int) -> None:
        if stats["compiles"]:
            raise Refused(f"compiled {stats['compiles']} program(s) during a timed run")
        expected = self._expected_dispatches(epochs)
        if expected is not None and stats["dispatches"] != expected:
            raise Refused(f"{stats['dispatches']} dispatches, expected {expected}")
        if self.resident and stats["h2d_transfers"]:
            raise Refused(
                f"{stats['h2d_transfers']} host-to-device transfers: the data was "
                f"not device-resident"
            )

    def sample(self, epochs: int) -> Sample:
        began = time.perf_counter()
        state = self.loop.run(self.data, self.w.variables, epochs=epochs + 1, fuse=self.fuse)
        _block(state.step_state)
        wall = time.perf_counter() - began
        stats = state.stats
        self._verify(stats, epochs + 1)
        times = [float(stats["epoch_time"][e]) for e in sorted(stats["epoch_time"])]
        info = {
            "run_wall_s": wall,
            "first_epoch_s": times[0],
            "dispatches_per_epoch": stats["dispatches"] / (epochs + 1),
            "host_syncs_per_epoch": stats["host_syncs"] / (epochs + 1),
            "h2d_transfers_per_epoch": stats["h2d_transfers"] / (epochs + 1),
            "chunk_size": stats["chunk_size"],
        }
        losses = [h["loss"] for h in state.history.values()]
        # One data point per sample, the mean of epochs 1..n: where nothing acts at an
        # epoch's end, the next epoch's first chunk is launched before the ending epoch is
        # read (docs/design.md §6), so its device work falls partly in the host's timing of
        # the epoch before. Single epochs then read too fast and too slow in turn (a minimum
        # below the floor's); their sum is the steady time, less at most one chunk's head
        # start over the n epochs.
        steady = times[1:]
        return Sample(
            [sum(steady) / len(steady)],
            devices_of(state.step_state),
            outputs=np.array(losses),
            params=jax.device_get(self.w.compared(state.step_state["params"])),
            info=info,
        )
