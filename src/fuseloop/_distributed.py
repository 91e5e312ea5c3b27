"""Multi-process runs under `jax.distributed`: set-up, per-process input, agreement checks.

`fuseloop launch -n N script.py` starts N processes with `FUSELOOP_COORDINATOR`,
`FUSELOOP_NUM_PROCESSES` and `FUSELOOP_PROCESS_ID` set; `import fuseloop` then calls
`initialize_from_environment()`, so the script needs no set-up of its own and runs unchanged
as `python script.py` (one process, where every function here is a cheap no-op).

Each process feeds only its share of every global batch; which rows those are, and how the
global arrays are built from the shares, is `_shards.py` (re-exported here). Computation
on global arrays is SPMD: every process sees the same loss and metrics. Side effects run
on process 0 (`main_process_only`) unless a handler asks for all processes
(`all_processes`). See docs/distributed.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import jax
import numpy as np

from ._prng_keys import raw_keys
from ._shards import assemble_global, local_indices, local_rows, place_rows, process_block

__all__ = [
    "describe_source",
    "describe_step",
    "describe_values",
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
    "place_rows",
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
# The line a launched process writes when an uncaught exception ends it (`fuseloop launch`
# reads it, does not print it, and names the first process that wrote it).
FAILED_MARK = "[fuseloop launch: this process failed]"


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
    _exit_at_once_on_error()
    return True


_CONSEQUENCE_DELAY = 1.0  # seconds
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "gloo", "heartbeat")


def _lost_a_peer(error: Any) -> bool:
    """Whether `error` says a collective lost another process (not a failure of its own)."""
    text = str(error).lower()
    return any(sign in text for sign in _LOST_PEER)


def _exit_at_once_on_error() -> None:
    """An uncaught exception ends this launched process at once, with exit code 1 after
    its traceback: otherwise jax's shutdown waits at a barrier for the other processes
    (which never reach it), then aborts, and the launcher could only report a SIGABRT of
    whichever process aborted first."""
    previous = sys.excepthook

    def hook(kind: Any, value: Any, traceback: Any) -> None:
        previous(kind, value, traceback)
        sys.stdout.flush()
        if _lost_a_peer(value):
            # A consequence of another process's end (killed, or failed first): that one
            # is the one to name, so this one leaves its exit to be seen after it.
            time.sleep(_CONSEQUENCE_DELAY)
        else:
            # Before this process's sockets close: the others fail once they do, and the
            # launcher names the process that marked its failure first.
            sys.stderr.write(FAILED_MARK + "\n")
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = hook


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


# ----------------------------------------------------------------- agreement
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def config_fingerprint(config: dict[str, Any]) -> dict[str, str]:
    """A comparable description of each configuration entry (shown in an error from where
    processes' entries differ: `_where_they_differ`).

    Example:
        >>> config_fingerprint({"epochs": 3})
        {'epochs': '3'}
    """
    # Memory addresses in reprs differ between processes running the same code.
    return {
        str(key): _ADDRESS.sub("0x", json.dumps(value, sort_keys=True, default=repr))
        for key, value in sorted(config.items())
    }


def _where_they_differ(texts: list[str]) -> list[str]:
    """Each process's entry as shown in the error: whole when short, else the 80 characters
    from just before where it first differs from another process's (a long entry, such as
    the handlers' settings, would otherwise hide the difference)."""
    if all(len(text) <= 80 for text in texts):
        return texts
    first = next(
        (i for i, chars in enumerate(zip(*texts, strict=False)) if len(set(chars)) > 1),
        min(map(len, texts)),
    )
    start = max(first - 30, 0)
    return [("..." if start else "") + t[start : start + 80] + "..." for t in texts]


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
    return f"{text} values:{describe_values(tree)}" if values else text


def describe_values(tree: Any) -> str:
    """A digest of a pytree's values alone (a host read of every leaf).

    Example:
        >>> describe_values({"w": np.zeros(2, np.float32)}) == describe_values([np.zeros(2)])
        False
    """
    digest = hashlib.sha256()
    leaves = [raw_keys(leaf) for leaf in jax.tree.leaves(tree)]  # (numpy reads no key)
    for leaf in jax.device_get(leaves):  # host sync point: every leaf, once
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()[:16]


def describe_source(data: Any) -> str:
    """What every process must agree on about a data source: for `fl.data.arrays` its
    size, batch size, shuffling and seed (each process takes its share of one global
    order); for a sized source its number of batches (each holds its own share).

    Example:
        >>> describe_source([(0, 0)] * 3)
        '3 batches'
    """
    fields = ("n", "batch_size", "shuffle", "seed", "drop_remainder")
    if all(hasattr(data, field) for field in fields):
        return ", ".join(f"{field}={getattr(data, field)!r}" for field in fields)
    try:
        return f"{len(data)} batches"
    except TypeError:  # an iterator or a callable: its length is not known here
        return type(data).__name__


def describe_step(program: Any, step_state: Any, batch: Any) -> str:
    """A digest of the training step as traced (its jaxpr): constants outside the step
    state, such as a fixed learning rate, show in it."""
    try:
        text = str(jax.make_jaxpr(program.step)(step_state, batch))
    except Exception as error:  # noqa: BLE001 - a step that cannot be traced alone: not compared
        return f"not traced ({type(error).__name__})"
    return hashlib.sha256(_ADDRESS.sub("0x", text).encode()).hexdigest()[:16]


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
            shown = ", ".join(f"process {i}: {v}" for i, v in enumerate(_where_they_differ(values)))
            differences.append(f"{key} ({shown})")
    if differences:
        raise ValueError(
            f"the processes of this {what} were given different configurations: "
            f"{'; '.join(differences)}. Every process must run the same script with the same "
            f"arguments (only its share of the data differs)"
        )


# ----------------------------------------------------------------- side effects
_ALL = "_fuseloop_all_processes"
_P = ParamSpec("_P")
_R = TypeVar("_R")


def all_processes(handler: Callable[_P, _R]) -> Callable[_P, _R]:
    """Marks a handler to run on every process (by default handlers with side effects run
    on process 0 only).

    Example:
        >>> def record(state): ...
        >>> runs_on_all_processes(all_processes(record))
        True
    """
    _require_callable(handler, "all_processes")
    try:
        setattr(handler, _ALL, True)
        return handler
    except AttributeError:  # e.g. a bound method: wrap it

        @functools.wraps(handler)
        def marked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            return handler(*args, **kwargs)

        setattr(marked, _ALL, True)
        return marked


def _require_callable(handler: Any, decorator: str) -> None:
    if not callable(handler):
        raise ValueError(
            f"{decorator}({handler!r}): it marks a handler, a callable(state); decorate the "
            f"handler's def, or wrap it: {decorator}(my_handler)"
        )


def runs_on_all_processes(handler: Callable) -> bool:
    """Whether `handler` was marked with `all_processes`."""
    return bool(getattr(handler, _ALL, False))


def main_process_only(handler: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """`handler` on process 0; a no-op returning None (continue) on the others.

    A handler marked with `all_processes` is returned unchanged. Use it for handlers that
    only observe (log, progress, CSV, TensorBoard, plots): one that changes the State or
    halts must run on every process, or the processes diverge.

    Example:
        >>> main_process_only(lambda state: "seen")(None)
        'seen'
    """
    _require_callable(handler, "main_process_only")
    if runs_on_all_processes(handler):
        return handler

    @functools.wraps(handler)
    def on_main(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        if jax.process_index() != 0:
            return None
        return handler(*args, **kwargs)

    return on_main
