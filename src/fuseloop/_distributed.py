"""Multi-process runs under `jax.distributed`: set-up, per-process input, agreement checks.

`fuseloop launch -n N script.py` starts N processes with `FUSELOOP_COORDINATOR`,
`FUSELOOP_NUM_PROCESSES` and `FUSELOOP_PROCESS_ID` set; `import fuseloop` then calls
`initialize_from_environment()`, so the script needs no set-up of its own and runs unchanged
as `python script.py` (one process, where every function here is a cheap no-op).

Each process feeds only its share of every global batch (`local_rows`), and
`assemble_global` builds the global batch (or chunk of batches) from the shares with the
mesh's batch sharding. Computation on global arrays is SPMD: every process sees the same
loss and metrics. Side effects run on process 0 (`main_process_only`) unless a handler asks
for all processes (`all_processes`). See docs/distributed.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = [
    "ENV_COORDINATOR",
    "ENV_COUNT",
    "ENV_ID",
    "all_processes",
    "assemble_global",
    "check_same_config",
    "config_fingerprint",
    "describe",
    "initialize_from_environment",
    "is_main_process",
    "local_indices",
    "local_rows",
    "main_process_only",
    "process_block",
    "process_count",
    "process_index",
    "runs_on_all_processes",
    "sync",
]

ENV_COORDINATOR = "FUSELOOP_COORDINATOR"
ENV_COUNT = "FUSELOOP_NUM_PROCESSES"
ENV_ID = "FUSELOOP_PROCESS_ID"
ENV_TIMEOUT = "FUSELOOP_FAILURE_TIMEOUT"
# How long a process waits on a dead peer before jax reports it (seconds): the coordination
# service's heartbeat; bounded so a crashed process never leaves the others hanging.
DEFAULT_FAILURE_TIMEOUT = 10


# ----------------------------------------------------------------- set-up
def initialize_from_environment() -> bool:
    """Initialises `jax.distributed` when the process was started by `fuseloop launch`.

    Returns whether this call initialised it. Without the launcher's environment it does
    nothing (and imports nothing), so a plain `python script.py` stays one process.

    Example:
        >>> initialize_from_environment()  # outside `fuseloop launch`
        False
    """
    address = os.environ.get(ENV_COORDINATOR)
    if not address or _initialized():
        return False
    try:
        count, index = int(os.environ[ENV_COUNT]), int(os.environ[ENV_ID])
        timeout = int(os.environ.get(ENV_TIMEOUT, DEFAULT_FAILURE_TIMEOUT))
    except (KeyError, ValueError) as err:
        raise ValueError(
            f"fuseloop launch environment is incomplete or malformed ({err}): "
            f"{ENV_COORDINATOR}, {ENV_COUNT} and {ENV_ID} must all be set, as integers "
            f"for the last two"
        ) from None
    # Real collectives between CPU processes (the default CPU backend has none).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=index,
            initialization_timeout=max(timeout * 3, 30),
            heartbeat_timeout_seconds=timeout,
            shutdown_timeout_seconds=timeout,
        )
    except RuntimeError as err:
        raise RuntimeError(
            f"process {index} of {count} (started by fuseloop launch) could not initialise "
            f"jax.distributed: {err}. Import fuseloop before the script uses jax (before "
            f"jax.devices() or any computation)"
        ) from err
    return True


def _initialized() -> bool:
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - jax moved its private module
        return False
    return distributed.global_state.client is not None


def process_index() -> int:
    """This process's index (0 without `jax.distributed`).

    Example:
        >>> process_index()
        0
    """
    return jax.process_index()


def process_count() -> int:
    """The number of processes (1 without `jax.distributed`).

    Example:
        >>> process_count()
        1
    """
    return jax.process_count()


def is_main_process() -> bool:
    """Whether this is process 0, the one that performs side effects.

    Example:
        >>> is_main_process()
        True
    """
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier across processes (nothing with one process).

    Example:
        >>> sync("doc")
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------- per-process input
def local_rows(
    sharding: jax.sharding.Sharding, global_batch_size: int, batch_axis: int = 0
) -> slice:
    """The rows of every global batch this process feeds, under `sharding`.

    They are the rows the sharding places on this process's devices; they must be
    contiguous (a mesh built from `jax.devices()` in order gives that).

    Example:
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> sharding = jax.NamedSharding(mesh, jax.P("data"))
        >>> local_rows(sharding, 8)
        slice(0, 8, None)
    """
    shape = [1] * (batch_axis + 1)
    shape[batch_axis] = global_batch_size
    starts, stops = [], []
    device: jax.Device  # (this jaxlib has no stub for the devices the map holds)
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        if device.process_index != jax.process_index():
            continue
        rows = index[batch_axis]
        starts.append(rows.start or 0)
        stops.append(global_batch_size if rows.stop is None else rows.stop)
    if not starts:
        raise ValueError(
            "sharding places no part of the batch on this process's devices; "
            "build the mesh from jax.devices() (all processes' devices)"
        )
    first, last = min(starts), max(stops)
    covered: set[int] = set()
    for start, stop in zip(starts, stops, strict=True):
        covered.update(range(start, stop))
    if covered != set(range(first, last)):
        raise ValueError(
            "this process's devices hold non-contiguous rows of the batch; order the mesh's "
            "devices by process (jax.make_mesh or jax.devices() order do)"
        )
    return slice(first, last)


def process_block(global_batch_size: int) -> slice:
    """This process's contiguous share of a global batch: rows [p*B/P, (p+1)*B/P).

    It is what `local_rows` gives for a "data" mesh built from `jax.devices()` (devices
    are ordered by process), and what a data source uses when it does not know the mesh.

    Example:
        >>> process_block(8)
        slice(0, 8, None)
    """
    count = jax.process_count()
    if global_batch_size % count:
        raise ValueError(
            f"batch_size={global_batch_size} does not divide over {count} processes; each "
            f"process feeds an equal share of every global batch, so use a multiple of "
            f"{count}"
        )
    share = global_batch_size // count
    return slice(jax.process_index() * share, (jax.process_index() + 1) * share)


def local_indices(
    global_indices: np.ndarray, batch_size: int, sharding: jax.sharding.Sharding | None = None
) -> np.ndarray:
    """This process's part of the example indices of one global batch.

    `fl.data.arrays` given the full arrays calls this for each batch, so every process
    keeps the global order a single process would use and feeds only its own rows (those
    `sharding` places on its devices, or `process_block` without a sharding).

    Example:
        >>> local_indices(np.arange(8), 8)
        array([0, 1, 2, 3, 4, 5, 6, 7])
    """
    if jax.process_count() == 1:
        return global_indices
    if len(global_indices) != batch_size:
        raise ValueError(
            f"a last batch of {len(global_indices)} examples cannot be split across "
            f"{jax.process_count()} processes like batch_size={batch_size}; pass "
            f"drop_remainder=True"
        )
    rows = process_block(batch_size) if sharding is None else local_rows(sharding, batch_size)
    return global_indices[rows]


def assemble_global(local_tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """The global arrays whose rows on this process are `local_tree`'s leaves.

    `sharding` is the mesh's batch sharding (a `NamedSharding` over the batch axis; for a
    chunk of K batches, over axis 1). Every process calls it with its own rows, in the same
    order. With one process it is `jax.device_put(local_tree, sharding)`.

    Example:
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> sharding = jax.NamedSharding(mesh, jax.P("data"))
        >>> assemble_global({"x": np.ones((4, 2))}, sharding)["x"].shape
        (4, 2)
    """
    if jax.process_count() == 1:
        return jax.device_put(local_tree, sharding)
    return jax.tree.map(lambda leaf: _assemble_leaf(leaf, sharding), local_tree)


def _assemble_leaf(leaf: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        # Already global (a source that assembled its own batches): used as it is.
        if leaf.sharding != sharding:
            raise ValueError(
                f"a global array with sharding {leaf.sharding} was given where the mesh's "
                f"batch sharding {sharding} is expected; yield process-local numpy arrays "
                f"(fuseloop assembles them) or arrays with this sharding"
            )
        return leaf
    return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))


# ----------------------------------------------------------------- agreement
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def config_fingerprint(config: dict[str, Any]) -> dict[str, str]:
    """A short, comparable description of each configuration entry.

    Example:
        >>> config_fingerprint({"epochs": 3})
        {'epochs': '3'}
    """
    out = {}
    for key, value in sorted(config.items()):
        # Memory addresses in reprs differ between processes running the same code.
        text = _ADDRESS.sub("0x", json.dumps(value, sort_keys=True, default=repr))
        out[str(key)] = (
            text
            if len(text) <= 80
            else f"{text[:60]}... sha256:{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        )
    return out


def describe(tree: Any, values: bool = False) -> str:
    """A configuration entry for a pytree of arrays: its structure, shapes and dtypes, and
    with `values=True` a digest of its values (a host read of every leaf).

    Use it for the model's initial variables (a different model or seed shows) and the
    first batch (a different batch size shows).

    Example:
        >>> describe({"w": np.zeros((2, 3), np.float32)})
        "PyTreeDef({'w': *}) [((2, 3), 'float32')]"
    """
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [
        (tuple(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in leaves
    ]
    text = f"{treedef} {shapes}"
    if values:
        digest = hashlib.sha256()
        for leaf in jax.device_get(leaves):  # host sync point: one read of every leaf
            digest.update(np.ascontiguousarray(leaf).tobytes())
        text += f" values:{digest.hexdigest()[:16]}"
    return text


def _gather_text(text: str) -> list[str]:
    """Every process's `text`, in process order (two small collectives)."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([len(data)], np.int32))
    padded = np.zeros(int(np.max(lengths)), np.uint8)
    padded[: len(data)] = data
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), -1)
    return [bytes(row[: int(n)]).decode() for row, n in zip(every, np.ravel(lengths), strict=True)]


def check_same_config(config: dict[str, Any], what: str = "run") -> None:
    """Raises ValueError, on every process, when processes were given different
    configurations (batch size, epochs, model, ...): the message names each difference.

    A collective: every process calls it at the same point. Nothing with one process.

    Example:
        >>> check_same_config({"batch_size": 32, "epochs": 3})
    """
    if jax.process_count() == 1:
        return
    mine = config_fingerprint(config)
    every = [json.loads(t) for t in _gather_text(json.dumps(mine, sort_keys=True))]
    differences = []
    for key in sorted(set().union(*every)):
        values = [e.get(key, "<missing>") for e in every]
        if len(set(values)) > 1:
            shown = ", ".join(f"process {i}: {v}" for i, v in enumerate(values))
            differences.append(f"{key} ({shown})")
    if differences:
        raise ValueError(
            f"the processes of this {what} were given different configurations: "
            f"{'; '.join(differences)}. Every process must run the same script with the same "
            f"arguments (only its share of the data differs)"
        )


# ----------------------------------------------------------------- side effects
_ALL = "_fuseloop_all_processes"


def all_processes(handler: Callable) -> Callable:
    """Marks a handler to run on every process (by default handlers with side effects run
    on process 0 only).

    Example:
        >>> def record(state): ...
        >>> runs_on_all_processes(all_processes(record))
        True
    """
    try:
        setattr(handler, _ALL, True)
        return handler
    except AttributeError:  # e.g. a bound method: wrap it

        @functools.wraps(handler)
        def marked(*args: Any, **kwargs: Any) -> Any:
            return handler(*args, **kwargs)

        setattr(marked, _ALL, True)
        return marked


def runs_on_all_processes(handler: Callable) -> bool:
    """Whether `handler` was marked with `all_processes`."""
    return bool(getattr(handler, _ALL, False))


def main_process_only(handler: Callable) -> Callable:
    """`handler` on process 0; a no-op returning None (continue) on the others.

    A handler marked with `all_processes` is returned unchanged. Use it for handlers that
    only observe (log, progress, CSV, TensorBoard, plots): one that changes the State or
    halts must run on every process, or the processes diverge.

    Example:
        >>> main_process_only(lambda state: "seen")(None)
        'seen'
    """
    if runs_on_all_processes(handler):
        return handler

    @functools.wraps(handler)
    def on_main(*args: Any, **kwargs: Any) -> Any:
        if jax.process_index() != 0:
            return None
        return handler(*args, **kwargs)

    return on_main
