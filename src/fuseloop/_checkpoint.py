"""`save_state` / `load_state`: the whole State on disk, written atomically, no pickle.

A save is a directory written by orbax-checkpoint (atomic finalize: it is written under a
hidden temporary name and renamed into place when complete; every process of a
multi-process run takes part):

    state/metadata   JSON: format and version, a readable summary (epoch, iteration,
                     status), the step state's tree structure, and every other State field
                     (history, metrics, counters, handler metadata, event counts, times)
    arrays/          the arrays, numbered as the JSON refers to them (orbax PyTree)

What a save can hold and how it is rebuilt without pickle: see `_json_tree`. Loading never
unpickles and never imports a module, so a crafted directory cannot run code.

A directory written by fuseloop's first format (`state.pkl`, a pickle) is refused with a
message that says how to recover its arrays (`read_legacy_arrays`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._arg_types import refuse_deleted_arrays, refuse_stateless_save, require_room, user_path
from ._json_tree import decode, encode
from ._state import State, freeze_arrays

__all__ = ["FORMAT", "is_save", "load_state", "read_legacy_arrays", "save_state"]

FORMAT = "fuseloop-state"
VERSION = 2
LEGACY_VERSION = 1
_STATE, _ARRAYS, _JSON_FILE = "state", "arrays", "metadata"
_LEGACY_INFO, _LEGACY_PICKLE = "info.json", "state.pkl"


# ----------------------------------------------------------------- State <-> JSON + arrays
def to_payload(state: State) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The JSON document and the host arrays that together hold `state`.

    Raises:
        ValueError: naming the field or key of a value that cannot be saved.
    """
    arrays: list[Any] = []
    step_state = encode(state.step_state, arrays, "step_state")
    fields = {
        f.name: encode(getattr(state, f.name), arrays, f.name)
        for f in dataclasses.fields(state)
        if f.name != "step_state"
    }
    summary = {
        "epoch": state.epoch,
        "iteration": state.iteration,
        "status": state.status,
        "epochs_in_history": sorted(int(e) for e in state.history),
    }
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "summary": summary,
        "n_arrays": len(arrays),
        "step_state": step_state,
        "fields": fields,
    }
    return payload, host_copies(arrays)


def host_copies(arrays: list[Any]) -> list[np.ndarray]:
    """Numpy copies of `arrays` (they survive later donation and asynchronous writes).

    Host sync point: one device-to-host read for all arrays. An array sharded across
    processes is gathered first (a collective: every process saves).
    """
    gathered = []
    for array in arrays:
        if (
            isinstance(array, jax.Array)
            and not array.is_fully_addressable
            and not array.is_fully_replicated
        ):
            from jax.experimental import multihost_utils

            array = multihost_utils.process_allgather(array, tiled=True)
        gathered.append(array)
    return [np.array(a) for a in jax.device_get(gathered)]


def from_payload(payload: Any, arrays: list[np.ndarray], where: str) -> State:
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"path={where!r} is not a fuseloop save")
    if payload.get("version") != VERSION:
        raise ValueError(
            f"path={where!r} holds fuseloop save format version "
            f"{payload.get('version')!r}; this fuseloop reads version {VERSION}"
        )
    fields = payload.get("fields")
    known = {f.name for f in dataclasses.fields(State)} - {"step_state"}
    if not isinstance(fields, dict) or not set(fields) <= known:
        raise ValueError(f"path={where!r}: the save's State fields are damaged")
    values = {name: decode(value, arrays, name) for name, value in fields.items()}
    freeze_arrays(values.get("metrics"), *values.get("history", {}).values())
    return State(step_state=decode(payload.get("step_state"), arrays, "step_state"), **values)


def save_args(state: State) -> Any:
    """orbax `Composite` arguments that save `state` (its arrays already on the host)."""
    import orbax.checkpoint as ocp

    payload, arrays = to_payload(state)  # its errors name a field: before the next one's
    refuse_stateless_save(state)
    items = {_STATE: ocp.args.JsonSave(payload)}
    if arrays:
        items[_ARRAYS] = ocp.args.PyTreeSave({f"leaf_{i:06d}": a for i, a in enumerate(arrays)})
    return ocp.args.Composite(**items)


# ----------------------------------------------------------------- reading
def _read_json(file: Path) -> Any:
    with open(file) as handle:
        return json.load(handle)


def save_version(path: Path) -> int | None:
    """VERSION for a complete save, LEGACY_VERSION for the first (pickle) format, else None."""
    path = Path(path).expanduser()
    try:
        if _read_json(path / _STATE / _JSON_FILE).get("format") == FORMAT:
            return VERSION
    except (OSError, ValueError, AttributeError):
        pass
    try:
        if _read_json(path / _LEGACY_INFO).get("format") == FORMAT:
            return LEGACY_VERSION
    except (OSError, ValueError, AttributeError):
        pass
    return None


def is_save(path: Path) -> bool:
    """Whether `path` is one complete save (of this format or the first one)."""
    return save_version(path) is not None


class _DamagedSave(ValueError):
    """A save whose arrays cannot be read (a file of its `arrays/` lost or truncated)."""


def _load_arrays(folder: Path, count: int) -> list[np.ndarray]:
    if count == 0:
        return []
    import orbax.checkpoint as ocp

    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            tree = checkpointer.restore(folder)
    except (OSError, ValueError) as error:  # orbax's and tensorstore's own words
        raise _DamagedSave(
            f"path={str(folder.parent)!r}: the save is damaged, its arrays cannot be read "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]})."
        ) from error
    try:
        return [np.asarray(tree[f"leaf_{i:06d}"]) for i in range(count)]
    except KeyError as err:
        raise _DamagedSave(
            f"path={str(folder)!r} lacks the array {err}; the save is damaged"
        ) from None


def _refuse_damaged_metadata(path: Path, earlier: Path | None = None, named: bool = False) -> None:
    """A ValueError where `path` holds a save's metadata file that does not read as one (cut
    short, edited, overwritten), or lacks it where it is `named` as a checkpoint's save;
    the message names `earlier`, the complete save before it, if any."""
    file = path / _STATE / _JSON_FILE
    problem: str | None = "it is missing" if named else None
    if not file.is_file() and not named:
        return
    try:
        payload = _read_json(file)
        problem = None if isinstance(payload, dict) else "it holds no JSON object"
    except FileNotFoundError:
        pass  # `problem` says it is missing
    except (OSError, ValueError) as error:  # json's JSONDecodeError is a ValueError
        problem = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    if problem is None and payload.get("format") != FORMAT:
        problem = f"its format is {payload.get('format')!r}, not {FORMAT!r}"
    if problem is None:
        return
    before = (
        f" The checkpoint before it, {str(earlier)!r}, can be loaded: "
        f"fl.load_state({str(earlier)!r}) (or delete the damaged one)"
        if earlier is not None
        else ""
    )
    raise _DamagedSave(
        f"path={str(path)!r}: the save is damaged: its {_STATE}/{_JSON_FILE} cannot be read "
        f"({problem}).{before}"
    )


def _read_latest(saves: list[Path]) -> State:
    """The newest of a checkpoint directory's complete saves; a damaged one is an error
    naming the complete one before it."""
    try:
        return read_save(saves[-1])
    except _DamagedSave as error:
        if len(saves) < 2:
            raise
        earlier = str(saves[-2])
        raise _DamagedSave(
            f"{error} The checkpoint before it, {earlier!r}, can be loaded: "
            f"fl.load_state({earlier!r}) (or delete the damaged one)"
        ) from error.__cause__


def read_save(folder: Path) -> State:
    """Loads one save directory (never unpickles)."""
    if save_version(folder) == LEGACY_VERSION:
        raise ValueError(_legacy_message(folder))
    payload = _read_json(folder / _STATE / _JSON_FILE)
    count = payload.get("n_arrays") if isinstance(payload, dict) else None
    if type(count) is not int or count < 0:
        raise ValueError(f"path={str(folder)!r}: the save's array count is damaged")
    return from_payload(payload, _load_arrays(folder / _ARRAYS, count), str(folder))


def _legacy_message(folder: Path) -> str:
    return (
        f"path={str(folder)!r} was written by fuseloop's first save format, whose non-array "
        f"part is a pickle ({_LEGACY_PICKLE}); fuseloop no longer unpickles, because loading "
        f"a pickle can run arbitrary code. To recover: its arrays load safely with "
        f"fuseloop._checkpoint.read_legacy_arrays(path) (the step state's array leaves in "
        f"jax.tree.leaves order, and its info.json summary); rebuild the step state with "
        f"jax.tree.unflatten(jax.tree.structure(fresh_step_state), arrays) and save it again "
        f"with fl.save_state. If you trust the file, you may instead load it with the "
        f"fuseloop version that wrote it and save it again with this one"
    )


def read_legacy_arrays(path: str | os.PathLike[str]) -> tuple[list[np.ndarray], dict[str, Any]]:
    """The arrays and the JSON summary of a save in the first (pickle) format, read
    without unpickling anything.

    The arrays are the step state's array leaves in `jax.tree.leaves` order (typed PRNG
    keys as their key data).

    Example:
        >>> # Skipped: it needs a save in the first format, which no fuseloop writes now.
        >>> arrays, info = read_legacy_arrays("old_save")  # doctest: +SKIP
    """
    folder = Path(path).expanduser()
    if save_version(folder) != LEGACY_VERSION:
        raise ValueError(f"path={str(folder)!r} is not a save in fuseloop's first format")
    info = _read_json(folder / _LEGACY_INFO)
    if not (folder / _ARRAYS).exists():
        return [], info
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.restore(folder / _ARRAYS)
    return [np.asarray(tree[k]) for k in sorted(tree)], info


# ----------------------------------------------------------------- writing one save
def write_save(state: State, destination: Path) -> Path:
    """Writes `state` to `destination` (which must not exist) with orbax's atomic finalize."""
    import orbax.checkpoint as ocp

    from ._checkpoint_paths import HiddenTemporaryPath

    handler = ocp.CompositeCheckpointHandler()
    with ocp.Checkpointer(handler, temporary_path_class=HiddenTemporaryPath) as checkpointer:
        checkpointer.save(Path(destination).absolute(), args=save_args(state))
    return Path(destination)


def _staging(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}"


def save_state(state: State, path: str | os.PathLike[str]) -> Path:
    """Saves the whole State (arrays and host data) to the directory `path`, atomically.

    An existing save at `path` is replaced; anything else at `path` is refused. Only the
    State's values are saved, not the loop (its model, optimizer and handlers): resume with
    the same Loop, `loop.run(data, fl.load_state(path), epochs=N)`. Under
    `jax.distributed` every process calls it (the save is collective) with the same path.

    Args:
        state: The State to save (what `run` returned, or a handler's State at
            `epoch_completed`; one without a step state, which no run resumes, is refused).
        path: The directory to write.

    Returns:
        The path written.

    Raises:
        ValueError: for a value in the State that cannot be saved without pickle (the
            message names its field and key), a State without a step state, or a `path`
            holding something else.

    Example:
        >>> import tempfile, jax.numpy as jnp, fuseloop as fl
        >>> folder = tempfile.mkdtemp()
        >>> _ = fl.save_state(fl.State(epoch=2, step_state={"w": jnp.ones(2)}),
        ...                   folder + "/s")
        >>> fl.load_state(folder + "/s").epoch
        2
    """
    if not isinstance(state, State):
        raise ValueError(f"state={type(state).__name__} must be a fuseloop State")
    refuse_deleted_arrays(state.step_state, "state")
    given = f"path={str(path)!r}"
    path = user_path(path).absolute()
    require_room(path, given, "directory", "save")
    if not path.exists():
        return write_save(state, path)
    if not is_save(path):
        raise ValueError(
            f"path={str(path)!r} exists and is not a fuseloop save; refusing to replace it. "
            f"Pass a new path (or remove it)"
        )
    staging, backup = _staging(path, "new"), _staging(path, "old")
    from ._distributed import is_main_process, sync

    if is_main_process():
        shutil.rmtree(staging, ignore_errors=True)
    sync("fuseloop_save_state_staging")
    write_save(state, staging)
    if is_main_process():
        # Between these two renames `path` is briefly absent; load_state then finds the
        # previous save under its backup name.
        shutil.rmtree(backup, ignore_errors=True)
        os.rename(path, backup)
        os.rename(staging, path)
        shutil.rmtree(backup, ignore_errors=True)
    sync("fuseloop_save_state_swapped")
    return path


# ----------------------------------------------------------------- loading
def load_state(path: str | os.PathLike[str]) -> State:
    """Loads a State written by `save_state`, or the latest complete save in a directory
    written by `Loop.checkpoint`.

    The restored step state has the original pytree structure (optax NamedTuples, flax
    dicts, equinox modules), so `loop.run(data, fl.load_state(path), epochs=N)` resumes at
    epoch `max(history) + 1`. Nothing is unpickled and no module is imported: pytree types
    are looked up among the modules the program has imported.

    Example:
        >>> import tempfile, jax.numpy as jnp, fuseloop as fl
        >>> folder = tempfile.mkdtemp()
        >>> _ = fl.save_state(fl.State(step_state=1.0, history={0: {"loss": 1.5}}), folder + "/s")
        >>> fl.load_state(folder + "/s").history
        {0: {'loss': 1.5}}
    """
    from ._checkpoint_paths import checkpoint_dirs

    path = user_path(path).absolute()  # orbax reads absolute paths only
    if is_save(path):
        return read_save(path)
    named = checkpoint_dirs(path, lambda child: True) if path.is_dir() else []
    # A folder holding a save's two parts and no checkpoints is a save, damaged.
    parts = (path / _STATE).is_dir() and (path / _ARRAYS).is_dir()
    _refuse_damaged_metadata(path, named=parts and not named)
    if path.is_dir():
        saves = [child for child in named if is_save(child)]  # oldest first, as `named`
        if named and (not saves or named[-1] != saves[-1]):
            # Saves are renamed into place once complete: a named one that does not read
            # as a save was damaged after it was written.
            _refuse_damaged_metadata(named[-1], saves[-1] if saves else None, named=True)
        if saves:
            return _read_latest(saves)
        members = sorted(child.name for child in path.glob("member_*") if child.is_dir())
        if members:  # a population's checkpoint on best: one folder of saves per member
            raise ValueError(
                f"path={str(path)!r} holds a population's saves, one folder per member "
                f"({', '.join(members[:3])}{', ...' if len(members) > 3 else ''}): load a "
                f"member's, e.g. fl.load_state({str(path / members[0])!r})"
            )
        raise ValueError(
            f"path={str(path)!r} holds no complete save: expected a directory written by "
            f"fl.save_state or one written by Loop.checkpoint (checkpoint_* subdirectories)"
        )
    backup = _staging(path, "old")
    if is_save(backup):  # a replacement by save_state was interrupted between renames
        return read_save(backup)
    if path.exists():
        raise ValueError(
            f"path={str(path)!r} is a file, not a save: give the directory written by "
            f"fl.save_state or by Loop.checkpoint"
        )
    raise ValueError(f"path={str(path)!r} does not exist")
