"""The engine that runs a Loop (docs/design.md): feeds, the device loop's programs, the
carry, replay, the event bus and the run. It imports nothing public: `Loop.run` calls
`run_loop` and hands it what it needs."""

from __future__ import annotations

from typing import Any

from .._narrowing import warnings_of_one_run
from .._state import State
from .run import Run
from .serving import serving

__all__ = ["run_loop"]


def run_loop(loop: Any, data: Any, init_state: Any = None, **options: Any) -> State:
    """Runs `loop` over `data` (see `Loop.run`; `observer` replaces `progress`). The
    handlers that keep their run's state serve this run alone while it runs (`serving`);
    the runs nested in it (validation's) warn of their data once (`warnings_of_one_run`)."""
    with serving(loop.registrations), warnings_of_one_run():
        return Run(loop, data, init_state, **options).run()
