"""User code as a type checker reads it: CI's mypy checks this file (pyproject's `files`).

Nothing here runs (pytest only imports it, for doctests it has none). `assert_type` fails
the check where fuseloop's annotations lose a precise type to `Any`, and a
`# type: ignore[...]` that is not needed fails it too (`warn_unused_ignores`), so each
marked call proves the annotations catch that mistake.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import assert_type

import optax

import fuseloop as fl


def paths_and_handlers(loop: fl.Loop, folder: Path) -> None:
    loop.checkpoint(folder / "checkpoints").csv_log(folder / "log.csv")
    loop.tensorboard(folder / "events")
    listed = fl.handlers.checkpoint.list_checkpoints(folder / "checkpoints")
    assert_type(listed, list[Path])
    fl.handlers.checkpoint.list_checkpoints(3)  # type: ignore[arg-type]


def _note(state: fl.State) -> str:
    return str(state.epoch)


def decorated_handlers() -> tuple[Callable[[fl.State], str | None], Callable[[fl.State], int]]:
    @fl.all_processes
    def count(state: fl.State) -> int:
        return state.epoch

    note = fl.main_process_only(_note)
    note()  # type: ignore[call-arg]
    return note, count


def a_decorated_handler_keeps_its_type() -> Callable[[fl.State], int]:
    handler = fl.main_process_only(_note)
    return handler  # type: ignore[return-value]


def observers(loop: fl.Loop) -> None:
    loop.observe("epoch_completed", lambda state: None, filter={"every": 2})
    loop.observe("epoch_complete", lambda state: None)  # type: ignore[arg-type]
    loop.observe("epoch_completed", lambda state: None, filter="firts")  # type: ignore[arg-type]


def optional_fuse(fuse: fl.types.Fuse | None = None) -> fl.types.Fuse:
    return True if fuse is None else fuse


def predicting(loop: fl.Loop, state: fl.State) -> None:
    model = fl.models.mlp([4, 2])
    fl.predict(model, state, [[0.0]], fuse=4)
    fl.predict(model, state, [[0.0]], fuse="auto")  # type: ignore[arg-type]
    fl.trainer(model, "mse", optax.sgd(0.1)).run([], fuse="run")
