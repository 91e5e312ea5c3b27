"""Handlers that keep the state of the run they serve, one run at a time (docs/handlers.md,
"One run at a time").

Some handlers keep what their run needs on themselves and start it afresh when a run starts:
`early_stop(restore_best=True)` its best epoch's step state, `checkpoint` its numbering,
`csv_log` its columns, the trainer's epoch log the line it is about to print. Two runs using
the same such handler at once (one Loop run from two threads, or a run started from inside
one of its own handlers) would share that state, and one of them would return the other's
best params or write into the other's file, with no error. So a run claims every such
handler it has for as long as it runs, and a second claim is refused.

A handler class says it keeps its run's state with `fuseloop_serves_one_run = True` (an
instance may set it False: `early_stop` without `restore_best` keeps nothing). It is found
where it is attached, behind the handler (`_events.marked_objects`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from .._events import marked_objects

__all__ = ["serving"]

_MARKER = "fuseloop_serves_one_run"
_LOCK = threading.Lock()
# id(handler object) -> (ident, name) of the thread whose run holds it. The run's
# registrations keep each object alive while it is held, so its id names it.
_HELD: dict[int, tuple[int, str]] = {}
# What each kind of handler keeps on itself, for the refusal's message.
_KEEPS = {
    "EarlyStopping": "its best epoch's step state",
    "Checkpointer": "its save numbering",
    "CSVWriter": "its columns",
    "TensorBoardWriter": "its event file",
    "EpochSummary": "the epoch line it is about to print",
}


@contextlib.contextmanager
def serving(registrations: Iterable[Any]) -> Iterator[None]:
    """Holds each handler of `registrations` that serves one run at a time for the `with`
    body (a run); raises `RuntimeError` where another run holds one."""
    owners: dict[int, tuple[str, str]] = {}
    for registration in registrations:
        name = registration.name.split(":")[0]  # "csv_log:start" is csv_log's
        for owner in marked_objects(registration.handler, _MARKER):
            kind = type(owner).__name__
            owners.setdefault(id(owner), (name or kind, _KEEPS.get(kind, "its run's state")))
    me = (threading.get_ident(), threading.current_thread().name)
    held = False
    try:
        with _LOCK:
            busy = {key: owners[key] for key in owners if key in _HELD}
            if busy:
                raise _busy_error(busy, me)
            held = True  # before the update: an interrupt between them leaves nothing held
            _HELD.update(dict.fromkeys(owners, me))
        yield
    finally:
        if held:
            with _LOCK:
                for key in owners:
                    _HELD.pop(key, None)


def _busy_error(busy: dict[int, tuple[str, str]], me: tuple[int, str]) -> RuntimeError:
    names = sorted({name for name, _ in busy.values()})
    keeps = "; ".join(sorted({f"{name}: {keeps}" for name, keeps in busy.values()}))
    holders = {_HELD[key] for key in busy}
    ongoing = (
        "a run of this thread that has not returned (a run started from one of its handlers?)"
        if holders == {me}
        else f"a run in another thread ({', '.join(sorted(n for _, n in holders))})"
    )
    subject = (
        f"the handler {names[0]} is" if len(names) == 1 else f"the handlers {', '.join(names)} are"
    )
    return RuntimeError(
        f"run: {subject} serving {ongoing}. Each keeps that run's state on itself ({keeps}), "
        "so two runs sharing it would mix their results. Loops built from one Loop (its "
        "builder methods, a trainer's log=N) share its handlers. Give each concurrent run its "
        "own Loop, built with its own handlers (build the trainer in the thread that runs "
        "it), or run them one after the other."
    )
