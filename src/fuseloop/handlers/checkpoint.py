"""`Loop.checkpoint`: one atomically written save per firing, in a directory.

Saves are `<path>/checkpoint_<seq>_epoch_<e>`, numbered in the order they were written
(a resumed run continues the numbering). Each is written under a hidden temporary name and
renamed into place when complete; `keep=N` removes the oldest only after the new one is in
place, so a process killed at any moment leaves the last good checkpoint loadable.

When a run halts (early stopping, SIGINT/SIGTERM, terminate_on_nan), the final State is
saved too, unless the last checkpoint already holds it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from .._checkpoint import _CHECKPOINT_DIR, checkpoint_dirs, write_atomically
from .._state import State
from .monitor import Monitor

__all__ = ["Checkpointer", "list_checkpoints"]


def list_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in a `Loop.checkpoint` directory, oldest first.

    Example:
        >>> first = fl.load_state(list_checkpoints("ckpts")[0])  # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory")
    return checkpoint_dirs(path)


def _position(state: State) -> tuple[int, int]:
    """Where a State is in its run: the epoch and the iterations completed so far."""
    counts = state.event_counts.get("iteration_completed") or {}
    return state.epoch, int(counts.get("total", 0)) if isinstance(counts, dict) else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process
        return True
    return True


class Checkpointer:
    """Saves the whole State under `path` when its event fires.

    Args:
        path: The directory that holds the checkpoints (created if needed).
        criteria: None (save at every firing) or a metric name: save only when it improves.
        mode: "min" or "max" for `criteria`.
        keep: None (keep all) or the number of newest checkpoints to keep.

    Example:
        >>> loop = loop.checkpoint("ckpts", criteria="validation_loss", keep=2)  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], criteria: str | None = None,
                 mode: str = "min", keep: int | None = None, key: str = ""):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path={path!r} must be a directory path")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or keep < 1):
            raise ValueError(f"keep={keep!r} must be None (keep all) or a positive int")
        self.path, self.keep = Path(path), keep
        self.monitor = None
        if criteria is not None:
            self.monitor = Monitor(criteria, mode, patience=0,
                                   key=key or f"checkpoint:{criteria}")
        elif mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is not a mode; accepted values: min, max")
        self._cleaned = False
        self._last_saved: tuple[int, int] | None = None

    def __call__(self, state: State) -> tuple[str, State] | None:
        if state.step_state is None:
            raise ValueError(
                "checkpoint: the State has no step state here (inside iteration events of a "
                "fused loop step_state is None); checkpoint on an epoch event (the default) "
                "or run with fuse=False"
            )
        changed = None
        if self.monitor is not None:
            value = self.monitor.value(state)
            record, improved = self.monitor.update(self.monitor.record(state), value,
                                                   state.epoch)
            changed = self.monitor.store(state, record)
            if not improved:
                return "continue", changed
            # The saved State holds the updated record, so a resumed run compares against
            # the best value this very checkpoint has.
            state = changed
        self.save(state)
        return None if changed is None else ("continue", changed)

    def on_halted(self, state: State) -> None:
        """Saves the final State of a halted run (early stopping, a signal, a NaN), unless
        the last save already holds it. Checkpoint-on-best does not save here."""
        if self.monitor is not None or state.step_state is None:
            return
        if self._last_saved != _position(state):
            self.save(state)

    def save(self, state: State) -> Path:
        """Writes one checkpoint and prunes old ones (only after it is complete)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self._cleaned:
            self._remove_stale()
            self._cleaned = True
        destination = self.path / f"checkpoint_{self._next_number():06d}_epoch_{state.epoch}"
        write_atomically(state, destination)
        self._last_saved = _position(state)
        if self.keep is not None:
            self._prune()
        return destination

    def _next_number(self) -> int:
        numbers = [int(m.group(1)) for m in map(_CHECKPOINT_DIR.match,
                                                 (p.name for p in self.path.iterdir())) if m]
        return max(numbers, default=0) + 1

    def _prune(self) -> None:
        saves = checkpoint_dirs(self.path)
        for old in saves[: max(len(saves) - self.keep, 0)]:
            # Renamed away first (atomic), so a kill mid-delete never leaves a partial
            # directory under a checkpoint name.
            doomed = self.path / f".del-{old.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Removes temporary directories left by processes that died mid-save."""
        for child in self.path.iterdir():
            if not child.name.startswith((".tmp-", ".del-")):
                continue
            try:
                pid = int(child.name.rsplit("-", 2)[-2])
            except (ValueError, IndexError):
                continue
            if pid != os.getpid() and not _alive(pid):
                shutil.rmtree(child, ignore_errors=True)
