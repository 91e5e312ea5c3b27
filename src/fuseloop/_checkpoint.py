"""`save_state` / `load_state`: the whole State on disk, written atomically.

A save is a directory:

    arrays/      the step state's arrays (orbax-checkpoint, saved from host numpy copies)
    state.pkl    everything else: the step state's tree structure (optax NamedTuples
                 included, so a restored optimizer state has the original pytree type),
                 epoch and counters, metrics, history, handler metadata, event counts,
                 status, times
    info.json    a small human-readable summary, written last

It is written into a hidden temporary directory next to its destination, flushed to disk,
and renamed into place: a process killed mid-save leaves at most a stray temporary
directory, never a half-written save under the final name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._state import State

__all__ = ["save_state", "load_state", "write_atomically", "is_save", "FORMAT"]

FORMAT = "fuseloop-state"
VERSION = 1
_INFO, _PICKLE, _ARRAYS = "info.json", "state.pkl", "arrays"
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)")


# ----------------------------------------------------------------- arrays <-> disk
def _array_kind(leaf: Any) -> str | None:
    """"key" (typed PRNG key), "jax", "numpy", or None (kept as a Python object)."""
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return "key"
        return "jax"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "numpy"
    return None


def _split(step_state: Any) -> tuple[Any, list[Any], list[Any]]:
    """(skeleton, host array leaves, per-leaf restore info).

    The skeleton is the step state with leaf i replaced by the int i. Pickling it rather
    than its PyTreeDef keeps node types whose aux data does not survive pickling a treedef
    (equinox modules), and optax NamedTuples come back as themselves.
    """
    leaves, treedef = jax.tree.flatten(step_state)
    skeleton = jax.tree.unflatten(treedef, list(range(len(leaves))))
    arrays, info = [], []
    for leaf in leaves:
        kind = _array_kind(leaf)
        if kind is None:
            info.append(("object", leaf))
            continue
        if kind == "key":
            info.append(("key", str(jax.random.key_impl(leaf)), len(arrays)))
            leaf = jax.random.key_data(leaf)
        else:
            info.append((kind, len(arrays)))
        arrays.append(leaf)
    # One device-to-host read for all arrays; numpy copies survive later donation.
    host = [np.array(a) for a in jax.device_get(arrays)]
    return skeleton, host, info


def _join(skeleton: Any, arrays: list[np.ndarray], info: list[Any]) -> Any:
    order, treedef = jax.tree.flatten(skeleton)
    if order != list(range(len(info))):
        raise ValueError("the saved step state's structure does not flatten back in order; "
                         "the save is damaged or its pytree types changed")
    leaves = []
    for entry in info:
        if entry[0] == "object":
            leaves.append(entry[1])
        elif entry[0] == "key":
            leaves.append(jax.random.wrap_key_data(arrays[entry[2]], impl=entry[1]))
        elif entry[0] == "jax":
            leaves.append(jax.device_put(arrays[entry[1]]))
        else:
            leaves.append(arrays[entry[1]])
    return jax.tree.unflatten(treedef, leaves)


def _save_arrays(arrays: list[np.ndarray], directory: Path) -> None:
    if not arrays:
        return
    import orbax.checkpoint as ocp

    tree = {f"leaf_{i:06d}": a for i, a in enumerate(arrays)}
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(directory, tree)


def _load_arrays(directory: Path, count: int) -> list[np.ndarray]:
    if count == 0:
        return []
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.restore(directory)
    return [np.asarray(tree[f"leaf_{i:06d}"]) for i in range(count)]


# ----------------------------------------------------------------- atomic writes
def _fsync_tree(root: Path) -> None:
    """Flushes every file and directory under `root` to disk (so a rename publishes data
    that is really there, also after a power loss)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory descriptors
        return
    try:
        os.fsync(descriptor)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(descriptor)


def temp_name(destination: Path) -> Path:
    """A hidden sibling of `destination` that names this process (for stale cleanup)."""
    return destination.parent / f".tmp-{destination.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_atomically(state: State, destination: Path) -> Path:
    """Writes `state` to a temporary sibling of `destination`, then renames it into place.

    `destination` must not exist.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = temp_name(destination)
    try:
        _write(state, staging)
        _fsync_tree(staging)
        os.rename(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_dir(destination.parent)
    return destination


def _write(state: State, folder: Path) -> None:
    folder.mkdir(parents=True)
    skeleton, arrays, info = _split(state.step_state)
    _save_arrays(arrays, folder / _ARRAYS)
    host = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.name != "step_state"}
    payload = {"format": FORMAT, "version": VERSION, "skeleton": skeleton, "leaves": info,
               "n_arrays": len(arrays), "fields": host}
    with open(folder / _PICKLE, "wb") as handle:
        pickle.dump(payload, handle, protocol=pickle.HIGHEST_PROTOCOL)
    summary = {"format": FORMAT, "version": VERSION, "epoch": state.epoch,
               "iteration": state.iteration, "status": state.status,
               "epochs_in_history": sorted(int(e) for e in state.history)}
    with open(folder / _INFO, "w") as handle:
        json.dump(summary, handle, indent=1)


def is_save(path: Path) -> bool:
    """Whether `path` is one complete save written by `save_state`."""
    try:
        with open(Path(path) / _INFO) as handle:
            return json.load(handle).get("format") == FORMAT
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------- public API
def save_state(state: State, path: str | os.PathLike[str]) -> Path:
    """Saves the whole State (arrays and host data) to the directory `path`, atomically.

    An existing save at `path` is replaced; anything else at `path` is refused. Only the
    State's values are saved, not the loop (its model, optimizer and handlers): resume with
    the same Loop, `loop.run(data, fl.load_state(path), epochs=N)`.

    Args:
        state: The State to save (e.g. what `run` returned, or a handler's State).
        path: The directory to write.

    Returns:
        The path written.

    Example:
        >>> fl.save_state(state, "run1/final")  # doctest: +SKIP
        >>> resumed = loop.run(data, fl.load_state("run1/final"), epochs=20)  # doctest: +SKIP
    """
    if not isinstance(state, State):
        raise ValueError(f"state={type(state).__name__} must be a fuseloop State")
    path = Path(path)
    if not path.exists():
        return write_atomically(state, path)
    if not is_save(path):
        raise ValueError(
            f"path={str(path)!r} exists and is not a fuseloop save; refusing to replace it. "
            f"Pass a new path (or remove it)"
        )
    staging = temp_name(path)
    backup = path.parent / f".old-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    write_atomically(state, staging)
    # Between these two renames `path` is briefly absent; load_state then finds the
    # previous save under its backup name.
    os.rename(path, backup)
    os.rename(staging, path)
    _fsync_dir(path.parent)
    shutil.rmtree(backup, ignore_errors=True)
    return path


def _read(folder: Path) -> State:
    with open(folder / _PICKLE, "rb") as handle:
        payload = pickle.load(handle)
    if payload.get("format") != FORMAT or payload.get("version") != VERSION:
        raise ValueError(f"path={str(folder)!r} holds an unknown save format "
                         f"({payload.get('format')!r} v{payload.get('version')!r})")
    arrays = _load_arrays(folder / _ARRAYS, payload["n_arrays"])
    step_state = _join(payload["skeleton"], arrays, payload["leaves"])
    return State(step_state=step_state, **payload["fields"])


def checkpoint_dirs(directory: Path) -> list[Path]:
    """The complete saves in a `Loop.checkpoint` directory, oldest first."""
    found = []
    for child in Path(directory).iterdir():
        match = _CHECKPOINT_DIR.match(child.name)
        if match and child.is_dir() and is_save(child):
            found.append((int(match.group(1)), child))
    return [child for _, child in sorted(found)]


def _backup_of(path: Path) -> Path | None:
    if not path.parent.is_dir():
        return None
    prefix = f".old-{path.name}-"
    backups = [p for p in path.parent.iterdir() if p.name.startswith(prefix) and is_save(p)]
    return max(backups, key=lambda p: p.stat().st_mtime) if backups else None


def load_state(path: str | os.PathLike[str]) -> State:
    """Loads a State written by `save_state`, or the latest complete save in a directory
    written by `Loop.checkpoint`.

    The restored step state has the original pytree structure (optax NamedTuples, flax
    dicts), so `loop.run(data, fl.load_state(path), epochs=N)` resumes at epoch
    `max(history) + 1`. Saves are pickled: load only files you trust.

    Example:
        >>> state = fl.load_state("checkpoints/")  # doctest: +SKIP
    """
    path = Path(path)
    if is_save(path):
        return _read(path)
    if path.is_dir():
        saves = checkpoint_dirs(path)
        if saves:
            return _read(saves[-1])
        raise ValueError(
            f"path={str(path)!r} holds no complete save: expected a directory written by "
            f"fl.save_state or one written by Loop.checkpoint (checkpoint_* subdirectories)"
        )
    backup = _backup_of(path)
    if backup is not None:  # a replacement by save_state was interrupted between renames
        return _read(backup)
    raise ValueError(f"path={str(path)!r} does not exist")
