"""Which systems a benchmark times on a workload, in table order: `(key, label, factory)`.

The MLPs and the zoo share the floor, fuseloop (fused, resident, unfused), the plain loop
and Keras; the MLPs add `fuse="auto"`, PyTorch, the rejected io_callback design and the
chunk-size sweep.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Plan", "mlp_plan", "zoo_plan"]

Plan = list[tuple[str, str, Callable[[], Any]]]


def _fuseloop_and_floors(w: Any, fuse: int, auto: bool) -> Plan:
    """The floors, fuseloop fused (host-fed and resident), `fuse="auto"` when `auto`,
    fuseloop unfused and the plain per-batch loop."""
    from ._systems import Floor, Fuseloop, PlainLoop

    plan: Plan = [
        (
            "floor",
            "floor: jit(lax.scan) over the epoch, data on device",
            lambda: Floor(w, transfer=False),
        ),
        (
            "floor_transfer",
            "floor incl. the epoch's one stack + device_put",
            lambda: Floor(w, transfer=True),
        ),
        (f"fl_fuse{fuse}", f"fuseloop fuse={fuse}", lambda: Fuseloop(w, fuse)),
        (
            f"fl_fuse{fuse}_resident",
            f"fuseloop fuse={fuse}, device-resident data",
            lambda: Fuseloop(w, fuse, resident=True),
        ),
    ]
    if auto:
        plan.append(("fl_fuseauto", "fuseloop fuse='auto'", lambda: Fuseloop(w, "auto")))
    plan += [
        ("fl_unfused", "fuseloop fuse=False", lambda: Fuseloop(w, False)),
        ("plain", "plain per-batch jax.jit + optax, float(loss) each step", lambda: PlainLoop(w)),
    ]
    return plan


def _keras(w: Any) -> Plan:
    from ._peers import KerasFit

    return [
        ("keras_spe1", "Keras 3 fit (JAX), steps_per_execution=1", lambda: KerasFit(w, 1)),
        ("keras_spe32", "Keras 3 fit (JAX), steps_per_execution=32", lambda: KerasFit(w, 32)),
    ]


def mlp_plan(w: Any, sweep_ks: Sequence[int], peers: bool, fuse: int) -> Plan:
    """Every system timed on an MLP workload `w`, with the sweep's chunk sizes last."""
    from ._peers import TorchEager
    from ._systems import Fuseloop, HostCallback

    plan = _fuseloop_and_floors(w, fuse, auto=True)
    if peers:
        plan += _keras(w)
        plan.append(
            (
                "torch",
                "PyTorch eager, loss.item() each step (faster of default/1 thread)",
                lambda: TorchEager(w),
            )
        )
    plan.append(
        (
            "io_callback",
            "rejected design: device loop, io_callback per batch",
            lambda: HostCallback(w),
        )
    )
    for k in sweep_ks:
        if k != fuse:
            plan.append((f"fl_fuse{k}", f"fuseloop fuse={k}", functools.partial(Fuseloop, w, k)))
    return plan


def zoo_plan(w: Any, peers: bool, fuse: int) -> Plan:
    """Every system timed on a zoo model: the shared ones, and Keras with `peers`."""
    return _fuseloop_and_floors(w, fuse, auto=False) + (_keras(w) if peers else [])
