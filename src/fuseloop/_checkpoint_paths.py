"""Names on disk: checkpoint directories and orbax's temporary directories.

A `Loop.checkpoint` directory holds `checkpoint_<seq>_epoch_<e>` saves. orbax writes each
one under a hidden temporary name (`.checkpoint_..._epoch_<e>.orbax-checkpoint-tmp`) and
renames it into place when it is complete, so nothing under a checkpoint name is ever
partial; the manager moves pruned saves into `.trash` (an atomic rename) before they are
deleted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

from etils import epath
from orbax.checkpoint.path import atomicity
from orbax.checkpoint.path import step as step_lib

__all__ = ["CHECKPOINT_NAME", "TRASH", "EpochNames", "HiddenTemporaryPath", "checkpoint_dirs"]

CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)_epoch_(\d+)$")
TRASH = ".trash"
_SUFFIX = atomicity.TMP_DIR_SUFFIX


class HiddenTemporaryPath(atomicity.AtomicRenameTemporaryPath):
    """orbax's atomic-rename finalize, with the temporary directory's name hidden (a dot
    first), so that no partial directory ever starts with a save's name."""

    @classmethod
    def from_final(
        cls, final_path, *, checkpoint_metadata_store=None, file_options=None, snapshot_type=None
    ):
        temporary = final_path.parent / f".{final_path.name}{_SUFFIX}"
        return cls(
            temporary,
            final_path,
            checkpoint_metadata_store=checkpoint_metadata_store,
            file_options=file_options,
            snapshot_type=snapshot_type,
        )

    @classmethod
    def from_temporary(cls, temporary_path, *, file_options=None, snapshot_type=None):
        name = temporary_path.name
        final = name[1 if name.startswith(".") else 0 : name.find(_SUFFIX)]
        return cls(
            temporary_path,
            temporary_path.parent / final,
            file_options=file_options,
            snapshot_type=snapshot_type,
        )


class EpochNames(step_lib.NameFormat):
    """orbax step names `checkpoint_<step:06d>_epoch_<epoch>`.

    The epoch of the step about to be saved is set with `next_epoch` before the save.
    """

    def __init__(self) -> None:
        self._epochs: dict[int, int] = {}

    def next_epoch(self, step: int, epoch: int) -> None:
        self._epochs[step] = epoch

    def build_name(self, step: int) -> str:
        if step not in self._epochs:
            raise ValueError(f"no epoch was set for checkpoint step {step}")
        return f"checkpoint_{step:06d}_epoch_{self._epochs[step]}"

    def _metadata(self, path: Path) -> step_lib.Metadata | None:
        match = CHECKPOINT_NAME.match(path.name)
        if match is None or not path.is_dir():
            return None
        step, epoch = int(match.group(1)), int(match.group(2))
        self._epochs.setdefault(step, epoch)
        return step_lib.Metadata(step=step, path=epath.Path(path))

    def find_all(self, base_path) -> Iterator[step_lib.Metadata]:
        base = Path(base_path)
        if not base.is_dir():
            return iter(())
        found = [self._metadata(child) for child in base.iterdir()]
        return iter([m for m in found if m is not None])

    def find_step(self, base_path, step: int) -> step_lib.Metadata:
        for metadata in self.find_all(base_path):
            if metadata.step == step:
                return metadata
        raise ValueError(f"no checkpoint for step {step} in {base_path}")


def checkpoint_dirs(directory: Path, is_save: Callable[[Path], bool]) -> list[Path]:
    """The complete saves (`is_save(path)`) in a `Loop.checkpoint` directory, oldest first.

    The caller passes `_checkpoint.is_save`, so this module does not import `_checkpoint`
    (which imports it).
    """
    found = []
    for child in Path(directory).iterdir():
        match = CHECKPOINT_NAME.match(child.name)
        if match and child.is_dir() and is_save(child):
            found.append((int(match.group(1)), child))
    return [child for _, child in sorted(found)]
