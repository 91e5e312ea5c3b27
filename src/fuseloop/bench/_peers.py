"""Peers outside JAX-by-hand: Keras 3 `fit` on the JAX backend, and PyTorch eager.

Both are optional: when one is not installed, or cannot use the device JAX runs on, its
rows say "skipped" with the reason instead of disappearing.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from ._guards import Skipped, devices_of
from ._systems import Sample, System
from ._workload import BenchWorkload

__all__ = ["KerasFit", "TorchEager", "import_keras"]


def import_keras() -> Any:
    """Imports Keras 3 on the JAX backend, or raises `Skipped` saying why it cannot."""
    if "keras" not in sys.modules:
        if importlib.util.find_spec("keras") is None:
            raise Skipped("keras not installed (pip install 'fuseloop[bench]')")
        # The backend is chosen once, at import time.
        os.environ["KERAS_BACKEND"] = "jax"
    try:
        import keras
    except Exception as error:  # a broken install must not stop the other rows
        raise Skipped(f"keras failed to import: {type(error).__name__}: {error}") from error
    if not hasattr(keras, "backend") or keras.backend.backend() != "jax":
        found = keras.backend.backend() if hasattr(keras, "backend") else "unknown"
        raise Skipped(f"keras was already imported with the {found!r} backend, not 'jax'")
    return keras


class KerasFit(System):
    """`model.fit(x, y, batch_size, epochs=n + 1, steps_per_execution=K)` on the JAX
    backend; epochs 1..n are timed from `on_epoch_begin` to `on_epoch_end` (steady state,
    like fuseloop's)."""

    def __init__(self, workload: BenchWorkload, steps_per_execution: int):
        super().__init__(workload)
        self.spe = steps_per_execution

    def setup(self) -> None:
        keras = import_keras()
        self.model = self.w.keras_model(keras)
        self.model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=self.spe,
            jit_compile=True,
        )
        self.timer = self._timer(keras)
        self.sample(1)

    @staticmethod
    def _timer(keras: Any) -> Any:
        class EpochTimer(keras.callbacks.Callback):
            def on_train_begin(self, logs: Any = None) -> None:
                self.seconds: list[float] = []

            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                self.began = time.perf_counter()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                self.seconds.append(time.perf_counter() - self.began)

        return EpochTimer()

    def sample(self, epochs: int) -> Sample:
        began = time.perf_counter()
        history = self.model.fit(
            self.w.x,
            self.w.y,
            batch_size=self.w.batch_size,
            epochs=epochs + 1,
            shuffle=False,
            verbose=0,
            callbacks=[self.timer],
        )
        wall = time.perf_counter() - began
        weights = [v.value for v in self.model.trainable_variables]
        jax.block_until_ready(weights)
        return Sample(
            self.timer.seconds[1:],
            devices_of(weights),
            outputs=np.array(history.history["loss"]),
            info={"fit_wall_s": wall, "first_epoch_s": self.timer.seconds[0]},
        )


class TorchEager(System):
    """A PyTorch eager loop on the device JAX uses (CPU here), reading the loss each step,
    with the faster of torch's default thread count and one thread."""

    def setup(self) -> None:
        if importlib.util.find_spec("torch") is None:
            raise Skipped("not installed (pip install 'fuseloop[torch]')")
        import torch

        self.torch = torch
        platform = jax.devices()[0].platform
        wanted = {"cpu": "cpu", "gpu": "cuda"}.get(platform)
        if wanted is None or (wanted == "cuda" and not torch.cuda.is_available()):
            raise Skipped(f"torch cannot run on JAX's device platform {platform!r} here")
        self.device = torch.device(wanted)
        self.intended = f"torch:{wanted}"
        spec = self.w.spec
        widths = (spec.inputs,) + spec.features
        layers: list[Any] = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            layers.append(torch.nn.Linear(a, b))
            if i < len(widths) - 2:
                layers.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*layers).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.batches = [(x, y.astype(np.int64)) for x, y in self.w.batches]
        self.sample(1)
        self._pick_threads()

    def _pick_threads(self) -> None:
        """Keeps the faster of torch's default intra-op threads and one thread.

        On a busy machine torch's spinning OpenMP threads can be 30x slower than one thread
        on these small matrices; the peer is shown at its best, not at its worst.
        """
        torch = self.torch
        seconds = {}
        for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
            torch.set_num_threads(threads)
            seconds[threads] = min(self.sample(1).seconds)
        torch.set_num_threads(min(seconds, key=lambda n: seconds[n]))

    def sample(self, epochs: int) -> Sample:
        seconds: list[float] = []
        for _ in range(epochs):
            seconds.append(self._epoch())
        found = {f"torch:{p.device.type}" for p in self.model.parameters()}
        found |= {f"torch:{x.device.type}" for x in self._last_inputs}
        return Sample(
            seconds,
            found,
            outputs=np.array(self._losses),
            info={"torch_threads": self.torch.get_num_threads()},
        )

    def _epoch(self) -> float:
        torch, device = self.torch, self.device
        losses = []
        began = time.perf_counter()
        for x_host, y_host in self.batches:
            x = torch.from_numpy(x_host).to(device)
            y = torch.from_numpy(y_host).to(device)
            self.optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            losses.append(loss.item())  # host sync, as a logging loop does
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        self._losses, self._last_inputs = losses, (x, y)
        return seconds
