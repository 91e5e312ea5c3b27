"""How a run's dispatches are shaped, decided once before the first epoch.

Per-epoch chunks of K steps (host feed or resident feed), or many epochs per dispatch on
device-resident data (docs/design.md §9): `fuse=K` beyond the epoch, `fuse="run"`, and
`fuse="auto"` when the cost model's K is longer than an epoch. Where epochs cannot be
crossed, `stats["whole_run"]` says why and the run keeps epoch-bounded chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from .._events import ITERATION_EVENTS
from .._fusion import DEFAULT_CHUNK
from .._warn import warn
from .auto_chunk import choose_chunk_size, epochs_per_dispatch
from .population_whole_run import PopulationWholeRun
from .whole_run import WholeRun, whole_run_refusal

__all__ = ["plan_dispatches", "epoch_length", "iteration_bound"]


def plan_dispatches(
    run: Any, step_state: Any, first: Any, warn_nonfinite: Callable[[Any], None]
) -> None:
    """Sets `run.whole` (a `WholeRun`) or resolves `run.fuse` to a chunk size, and records
    `stats["chunk_size"]` (and `stats["whole_run"]` where epochs could be crossed).
    """
    length = epoch_length(run.source, run.iterations)
    fuse = run.fuse
    if fuse == "auto":
        _warn_timed_halts(run, length)
    if run.resident and isinstance(fuse, int) and length is not None and fuse > length:
        _whole_run(run, fuse, length, warn_nonfinite)
    if run.fuse == "run":
        _whole_run(run, None, length, warn_nonfinite)
    if run.fuse == "auto":
        refusal = _refusal(run)
        if refusal is None:
            _auto_whole_run(run, step_state, first, length, warn_nonfinite)
        else:
            run.stats["whole_run"] = f"fuse='auto': {refusal}"
    if run.whole is not None:
        return
    if run.fuse == "auto":
        run.fuse = choose_chunk_size(
            run.programs, step_state, first, placement=run.placement, epoch_length=length
        )
    run.stats["chunk_size"] = run.fuse or 1


def _whole_run(
    run: Any, size: int | None, length: int | None, warn_nonfinite: Callable[[Any], None]
) -> None:
    """Many epochs per dispatch where the data allows; otherwise `fuse="run"` is one chunk
    per epoch (of `length` batches, or DEFAULT_CHUNK when unknown), and
    `stats["whole_run"]` says why.
    """
    length = length or DEFAULT_CHUNK
    refusal = _refusal(run)
    run.stats["whole_run"] = refusal or "many epochs per dispatch"
    if refusal is not None:
        run.fuse = length if size is None else size
        return
    whole = WholeRun if run.population is None else PopulationWholeRun
    run.whole = whole(run, size, warn_nonfinite)
    run.stats["chunk_size"] = size or length * (run.epochs - run.start_epoch)


_NEVER_HALT = ("checkpoint", "validate")  # the library's own handlers, which return None


def _warn_timed_halts(run: Any, length: int | None) -> None:
    """Warns where `fuse="auto"` meets a handler on an iteration event, which may halt: a
    halt takes effect at its chunk's end (README.md, "What fusion is"), and the cost model times
    this machine, so the steps trained after the halt could differ from one run of the same
    script to the next. Told whatever K this run's timing picks (even 1, exact here): the
    pick itself is what varies; an epoch of one batch has one place to halt."""
    handlers = [
        r
        for e in ITERATION_EVENTS
        for r in run.bus.by_event.get(e, ())
        if not r.observes and r.name not in _NEVER_HALT
    ]
    if not handlers or length == 1:
        return
    first = handlers[0]
    warn(
        f"fuse='auto' picks its chunk size by timing this machine, and {first.label!r} on "
        f"{first.event.value} may halt the run: a halt takes effect at the end of its chunk, "
        f"so the steps trained after it can differ from one run of this script to the next. "
        f"For halts that repeat, pass a fixed fuse=K (state.stats['chunk_size'] says what "
        f"'auto' chose) or fuse=False; a handler that never halts is attached with "
        f"loop.observe(...), which says so",
        UserWarning,
    )


def _refusal(run: Any) -> str | None:
    """Why this run cannot cross epochs in one dispatch (None: it can)."""
    if not run.resident:
        return "the data is host-fed: chunks stay within an epoch"
    return whole_run_refusal(run.source.data, run.iterations)


def _auto_whole_run(
    run: Any,
    step_state: Any,
    first: Any,
    length: int | None,
    warn_nonfinite: Callable[[Any], None],
) -> None:
    """`fuse="auto"` where epochs may be crossed: the cost model's K in whole epochs
    (auto_chunk.epochs_per_dispatch); one epoch or less keeps the per-epoch engine.
    """
    if length is None:
        return
    per, why = epochs_per_dispatch(
        run.programs, step_state, first, placement=run.placement, epoch_length=length
    )
    if per > 1:
        whole = None if per >= run.epochs - run.start_epoch else per * length
        _whole_run(run, whole, length, warn_nonfinite)
    else:
        run.stats["whole_run"] = f"fuse='auto': one epoch or less per dispatch ({why})"


def epoch_length(source: Any, iterations: int | None) -> int | None:
    """Batches per epoch where known (a sized re-iterable source, or `iterations`)."""
    known: list[int | None] = [] if iterations is None else [iterations]
    data = source.data
    if not source.one_shot:
        with contextlib.suppress(TypeError):  # an unsized source
            # A Keras-style sequence's wrapper counts its batches (`num_batches`, None
            # where it reads until `iterations=` ends the epoch).
            known.append(data.num_batches if hasattr(data, "num_batches") else len(data))
    lengths = [n for n in known if n is not None and n > 0]  # 0 yielding batches: unknown
    return min(lengths) if lengths else None


def iteration_bound(source: Any, iterations: int | None) -> int | None:
    """The State's `max_iteration`: `iterations`, or the epoch's length where the source
    knows it and it is shorter (under `iterations=8` an epoch of a list of 5 ends at its
    5th, and the log's `iteration i/N` says 5)."""
    known = source.epoch_length
    return iterations if iterations is None or known is None else min(iterations, known)
