"""Handlers that keep the state of the run they serve, one run at a time (docs/handlers.md,
"One run at a time").

Some handlers keep what their run needs on themselves and start it afresh when a run starts:
`early_stop` its best epoch's step state, `checkpoint` its numbering, `csv_log` its open
file. Two runs using the same such handler at once (one Loop run from two threads, or a run
started from inside one of its own handlers) would share that state, and one of them would
return the other's best params or write into the other's file, with no error. So a run
claims every such handler it has for as long as it runs, and a second claim is refused.

A handler class says it keeps its run's state with `fuseloop_serves_one_run = True`. It is
found where it is attached, behind the handler (`_events.marked_objects`).
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
# id(handler object) -> the thread whose run holds it. The run's registrations keep each
# object alive while it is held, so its id names it.
_HELD: dict[int, str] = {}


@contextlib.contextmanager
def serving(registrations: Iterable[Any]) -> Iterator[None]:
    """Holds each handler of `registrations` that serves one run at a time for the `with`
    body (a run); raises `RuntimeError` where another run holds one."""
    owners: dict[int, str] = {}
    for registration in registrations:
        for owner in marked_objects(registration.handler, _MARKER):
            owners.setdefault(id(owner), registration.name or type(owner).__name__)
    thread = threading.current_thread().name
    with _LOCK:
        busy = {key: name for key, name in owners.items() if key in _HELD}
        if busy:
            raise _busy_error(busy, thread)
        _HELD.update(dict.fromkeys(owners, thread))
    try:
        yield
    finally:
        with _LOCK:
            for key in owners:
                del _HELD[key]


def _busy_error(busy: dict[int, str], thread: str) -> RuntimeError:
    names = ", ".join(sorted(set(busy.values())))
    where = {_HELD[key] for key in busy}
    ongoing = (
        "a run of this thread that has not returned (a run started from one of its handlers?)"
        if where == {thread}
        else f"a run in another thread ({', '.join(sorted(where))})"
    )
    return RuntimeError(
        f"run: the handler {names} is serving {ongoing}. It keeps that run's state on "
        "itself (early_stop its best epoch's step state, checkpoint and the writers their "
        "files and numbering), so two runs sharing it would mix their results. Give each "
        "concurrent run its own Loop, built with its own handlers (build the trainer in "
        "the thread that runs it), or run them one after the other."
    )
