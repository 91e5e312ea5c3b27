"""Does a slow source overlap with the device? A fused epoch over data that takes `d` per
batch should cost about max(data, compute), not their sum (the chunk producer pulls and
stacks the next chunk while the device runs the current one)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

from ._guards import Refused, check_bitwise
from ._workload import BenchWorkload

__all__ = ["SlowSource", "overlap"]


class SlowSource:
    """A re-iterable over `batches` that sleeps `delay` seconds before each batch."""

    def __init__(self, batches: list[Any], delay: float):
        self.batches, self.delay = batches, delay

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            time.sleep(self.delay)
            yield batch


def overlap(workload: BenchWorkload, reps: int, fuse: int = 32) -> dict[str, Any]:
    """Times data alone, compute alone and the fused epoch over a slow source whose every
    batch takes as long as a fused step (measured first): the case where overlapping data
    and compute matters most.

    Returns medians in seconds per epoch and the two ratios; `status` is "refused" (with the
    reason) if the slow-source run did not train exactly what the in-memory run did.
    """
    from .. import trainer

    loop = trainer(workload.module, "sparse_categorical_cross_entropy", workload.tx)
    run = lambda data: loop.run(data, workload.variables, fuse=fuse)  # noqa: E731
    reference = run(workload.batches)  # also compiles
    step = min(run(workload.batches).stats["epoch_time"][0] for _ in range(2))
    delay = step / workload.n_batches
    slow = SlowSource(workload.batches, delay)
    data_s, compute_s, fused_s = [], [], []
    for _ in range(reps):
        began = time.perf_counter()
        for _batch in slow:
            pass
        data_s.append(time.perf_counter() - began)
        compute_s.append(run(workload.batches).stats["epoch_time"][0])
        state = run(slow)
        fused_s.append(state.stats["epoch_time"][0])
    out: dict[str, Any] = {
        "model": workload.spec.name,
        "fuse": fuse,
        "delay_us": delay * 1e6,
        "reps": reps,
        "status": "ok",
        "reason": "",
    }
    try:
        check_bitwise(state.params, reference.params, "slow source vs in-memory run")
    except Refused as why:
        out.update(status="refused", reason=str(why))
        return out
    data, compute, fused = (statistics.median(v) for v in (data_s, compute_s, fused_s))
    out.update(
        data_s=data,
        compute_s=compute,
        fused_s=fused,
        fused_over_max=fused / max(data, compute),
        fused_over_sum=fused / (data + compute),
    )
    return out
