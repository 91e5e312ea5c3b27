"""`Loop.checkpoint`: one atomically written save per firing, in a directory.

Saves are `<path>/checkpoint_<seq>_epoch_<e>`, numbered in the order they were written
(a resumed run continues the numbering), written by `orbax.checkpoint.CheckpointManager`:
each is written under a hidden temporary name and renamed into place when complete (orbax's
atomic finalize), and `keep=N` (orbax's `max_to_keep`) removes the oldest only after the new
one is in place, so a process killed at any moment leaves the last good checkpoint loadable.
Under `jax.distributed` every process takes part in each save (orbax's multi-process save).

When a run halts (early stopping, SIGINT/SIGTERM, terminate_on_nan), the final State is
saved too, unless the last checkpoint already holds it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from .._arg_types import is_int, require_room, user_path
from .._checkpoint import is_save, save_args
from .._checkpoint_paths import TRASH, EpochNames, HiddenTemporaryPath, checkpoint_dirs
from .._events import event_total
from .._json_tree import encode
from .._state import State
from .._types import Status
from .._warn import warn
from ..engine.population_monitors import checkpoint_members
from ._monitor_record import resolve_mode
from .monitor import Monitor

__all__ = ["Checkpointer", "list_checkpoints"]


def list_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in a `Loop.checkpoint` directory, oldest first.

    Example:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> state = loop.checkpoint(directory).run(batches, epochs=2)
        >>> first = fl.load_state(list_checkpoints(directory)[0])
        >>> first.epoch, len(list_checkpoints(directory))
        (0, 2)
    """
    path = user_path(path)
    if not path.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory")
    return checkpoint_dirs(path, is_save)


def _position(state: State) -> tuple[int, int]:
    """Where a State is in its run: the epoch and the iterations completed so far."""
    return state.epoch, event_total(state.event_counts, "iteration_completed")


def refuse_shared_directory(registrations: Any, saver: Checkpointer) -> None:
    """Refuses a second checkpoint handler of one loop on `saver`'s directory.

    Each numbers and prunes its saves alone, so one's `keep` would delete the other's (the
    best epoch's save, kept by a criteria handler) and their numbers would collide.
    """
    target = saver.path.resolve()
    for registration in registrations:
        other = getattr(registration.handler, "__wrapped__", registration.handler)
        if isinstance(other, Checkpointer) and other.path.resolve() == target:
            raise ValueError(
                f"checkpoint({str(saver.path)!r}): another checkpoint handler of this loop "
                f"saves into that directory already; give each handler a directory of its "
                f"own (e.g. {str(target) + '_best'!r} for a best-only one)"
            )


class Checkpointer:
    """Saves the whole State under `path` when its event fires.

    Args:
        path: The directory that holds the checkpoints (created if needed).
        criteria: None (save at every firing) or a metric name: save only when it improves.
            On a population, each member that improves is saved alone (`state.member(i)`)
            under `<path>/member_<i>/`, as its solo run would save it under `<path>`.
        mode: "min", "max" or "auto" (from the name's words) for `criteria`.
        keep: None (keep all) or the number of newest checkpoints to keep.
        asynchronous: Write in the background, so training does not wait on the disk (the
            State's arrays are copied to the host first). Attach `finish` to the
            "completed" and "halted" events so the last write ends before `run` returns.

    Example:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> saving = loop.validate(model, val_batches).checkpoint(
        ...     directory, criteria="validation_loss", keep=2)
        >>> state = saving.run(batches, epochs=3)
        >>> 1 <= len(fl.handlers.checkpoint.list_checkpoints(directory)) <= 2
        True
    """

    # One run at a time: it keeps its run's save numbering and manager (engine/serving.py).
    fuseloop_serves_one_run = True
    # It saves the step state, which a fused run's iteration events lack (engine/options.py).
    fuseloop_reads_step_state = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        criteria: str | None = None,
        mode: str = "min",
        keep: int | None = None,
        key: str = "",
        asynchronous: bool = False,
    ):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path={path!r} must be a directory path")
        where = Path(path).expanduser()  # "~/runs" is the home directory's, as in a shell
        require_room(where, f"path={str(path)!r}", "directory", "checkpoint directory")
        if is_save(where):  # its checkpoints would go inside it, and load_state read it
            raise ValueError(
                f"path={str(path)!r} is a save written by fl.save_state, not a checkpoint "
                f"directory: fl.load_state(path) would go on returning that save, not the "
                f"latest checkpoint. Resume from it with fl.load_state(path) and checkpoint "
                f"into another directory (e.g. {str(where.resolve()) + '_ckpt'!r})"
            )
        if keep is not None and (not is_int(keep) or keep < 1):
            raise ValueError(f"keep={keep!r} must be None (keep all) or a positive int")
        if not isinstance(asynchronous, bool):
            raise ValueError(f"asynchronous={asynchronous!r} must be True or False")
        keep = None if keep is None else int(keep)
        self.path, self.keep, self.asynchronous = where.absolute(), keep, asynchronous
        self.monitor = None
        mode = resolve_mode(mode, criteria, "criteria", "checkpoint")
        if criteria is not None:
            self.monitor = Monitor(
                criteria, mode, patience=0, key=key or f"checkpoint:{criteria}", argument="criteria"
            )
        elif mode == "max":  # it says which way `criteria` improves; without one, nothing
            raise ValueError(
                f"mode={mode!r} says which way criteria improves, but no criteria is given, "
                f"so every epoch would be saved: pass criteria= (the metric whose best "
                f"epochs to save, e.g. criteria='validation_accuracy'), or leave mode out"
            )
        self._manager: Any = None
        self._names = EpochNames()
        self._last_saved: tuple[int, int] | None = None
        self.members: dict[int, Checkpointer] = {}  # a population's per-member best saves
        self._numbered = 0  # the last number skipped since the last written save
        self._resumed = False  # whether the run resumed a State (`begin`)

    @property
    def on_device(self) -> str | None:
        """The device twin's name with `criteria` ("checkpoint"), else None.

        Inside a multi-epoch dispatch the best step states are kept on the device and this
        handler writes them at the dispatch's end (engine/device_checkpoint.py).
        """
        return "checkpoint" if self.monitor is not None else None

    def __call__(self, state: State) -> tuple[Status, State] | None:
        """Saves `state` when it is due (every `every` epochs, or on a new best)."""
        if state.step_state is None:
            raise ValueError(
                "checkpoint: the State has no step state here (inside iteration events of a "
                "fused loop step_state is None); checkpoint on an epoch event (the default) "
                "or run with fuse=False"
            )
        if self.monitor is None:
            self.save(state)
            return None
        if state.population is not None:
            return checkpoint_members(self, state)  # each member's own best, saved alone
        changed, improved = self.judge(state)
        if improved:
            self.save(changed)
        return "continue", changed

    def judge(self, state: State) -> tuple[State, bool]:
        """With `criteria`: the State with the record updated, and whether it improved.

        On an improvement that State is the one to save: a resumed run compares against
        the best value this very checkpoint holds.
        """
        if self.monitor is None:
            raise ValueError("checkpoint: judge needs criteria")
        value = self.monitor.value(state)
        record, improved = self.monitor.update(self.monitor.record(state), value, state.epoch)
        return self.monitor.store(state, record), improved

    def skip(self) -> None:
        """Numbers a save without writing it.

        For a multi-epoch dispatch's improvement that a later save of the same dispatch
        prunes (`keep`): the names on disk stay those of a run that wrote it.
        """
        self._numbered = self._next_number(self._open())

    def begin(self, state: State, check: bool = True) -> None:
        """A run starts (a handler for "started"): the last run's saves are not its own.

        What the last run saved does not count as this run's, and the directory is read
        afresh at the first save (it may have changed in between). With `check`, a step
        state no save could hold is refused now (a population's member savers skip it).
        """
        self.close()
        if check and state.step_state is not None:  # refused now, not after an epoch
            encode(state.step_state, [], "step_state")  # its structure: no array is read
        for member in self.members.values():
            member.begin(state, check=False)  # the same step state, checked above
        self._last_saved, self._numbered = None, 0
        self._resumed = bool(state.history)  # a fresh run is told of saves it did not make

    def on_halted(self, state: State) -> None:
        """Saves the final State of a halted run (early stopping, a signal, a NaN).

        Nothing is saved when the last save already holds it; checkpoint-on-best does not
        save here.
        """
        if self.monitor is not None or state.step_state is None:
            self.finish(state)
            return
        if self._last_saved != _position(state):
            self.save(state)
        self.finish(state)

    def finish(self, state: State | None = None) -> None:
        """Waits for writes in flight and releases the manager (a "completed"/"halted" handler).

        An asynchronous manager's thread would otherwise outlive the run.
        """
        for member in self.members.values():
            member.finish()
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._empty_trash()
            self.close()

    def save(self, state: State) -> Path:
        """Writes one checkpoint; orbax prunes old ones only after it is complete."""
        # A State that cannot be saved is refused before orbax's manager opens: an open
        # manager left behind by the error printed a traceback at interpreter exit.
        args = save_args(state)
        manager = self._open()
        step = self._next_number(manager)
        self._numbered = 0  # skipped numbers only matter until the next written save
        self._names.next_epoch(step, state.epoch)
        manager.save(step, args=args, force=True)
        if not self.asynchronous:
            manager.wait_until_finished()
        self._last_saved = _position(state)
        self._empty_trash()
        return self.path / self._names.build_name(step)

    def _warn_of_earlier_saves(self, manager: Any) -> None:
        """Warns where a run that resumed nothing finds saves in its directory.

        They are an earlier run's (a script run again): this run's saves are numbered
        after them, `keep` removes theirs first, and `fl.load_state` on the directory
        reads the newest of either.
        """
        steps = manager.all_steps()
        if not steps:
            return
        prunes = (
            f", and keep={self.keep} removes the oldest of both as it saves" if self.keep else ""
        )
        warn(
            f"checkpoint: {str(self.path)!r} already holds {len(steps)} checkpoint(s) this "
            f"run did not resume from; its saves are numbered after them{prunes}; "
            f"fl.load_state on the directory reads the newest of either run. To resume the "
            f"earlier run, pass fl.load_state(path) to run; to keep the runs apart, give "
            f"this one another directory"
        )

    def _next_number(self, manager: Any) -> int:
        return max(max(manager.all_steps(), default=0), self._numbered) + 1

    def _open(self) -> Any:
        """The CheckpointManager, created on the first save.

        Creating it cleans up the temporary directories of writers that died mid-save.
        """
        if self._manager is None:
            import orbax.checkpoint as ocp

            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                step_name_format=self._names,
                create=True,
                cleanup_tmp_directories=True,
                todelete_subdir=TRASH,
                enable_async_checkpointing=self.asynchronous,
                save_root_metadata=False,
                temporary_path_class=HiddenTemporaryPath,
            )
            self._manager = ocp.CheckpointManager(self.path, options=options)
            self._empty_trash()
            if not self._resumed:
                self._warn_of_earlier_saves(self._manager)
        return self._manager

    def _empty_trash(self) -> None:
        """Deletes saves the manager pruned (moved into the trash by an atomic rename)."""
        from .._distributed import is_main_process

        if is_main_process():
            shutil.rmtree(self.path / TRASH, ignore_errors=True)

    def close(self) -> None:
        """Waits for writes in flight and releases the manager."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None
