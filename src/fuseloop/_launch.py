"""`fuseloop launch -n N script.py [args]`: N local processes under `jax.distributed`.

Each process gets the coordinator address (127.0.0.1 and a free port), its process id and
the process count in its environment; `import fuseloop` initialises `jax.distributed` from
them with CPU collectives (gloo). Output is streamed line by line with a `[i] ` prefix. When
one process fails, the launcher stops the others (SIGTERM, then SIGKILL after a grace
period) and exits with the failing process's code, so a crash never leaves the rest hanging
in a collective. See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from ._arg_types import is_int
from ._distributed import (
    DEFAULT_FAILURE_TIMEOUT,
    ENV_COORDINATOR,
    ENV_COUNT,
    ENV_ID,
    ENV_TIMEOUT,
    FAILED_MARK,
)

__all__ = ["free_port", "launch"]

_POLL_SECONDS = 0.05
_MARK_SECONDS = 0.5  # how long a failure waits for a failure mark still in a pipe


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Example:
        >>> 1024 <= free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment(index: int, count: int, address: str, failure_timeout: int) -> dict:
    env = dict(os.environ)
    env.update(
        {
            ENV_COORDINATOR: address,
            ENV_COUNT: str(count),
            ENV_ID: str(index),
            ENV_TIMEOUT: str(failure_timeout),
            "PYTHONUNBUFFERED": "1",
        }
    )
    # Local processes share one machine: CPU devices unless the caller chose a platform.
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


class _FirstFailure:
    """The first process whose output marked an uncaught exception (`FAILED_MARK`)."""

    def __init__(self) -> None:
        self.index: int | None = None
        self.lock, self.marked = threading.Lock(), threading.Event()

    def mark(self, index: int) -> None:
        with self.lock:
            if self.index is None:
                self.index = index
                self.marked.set()

    def wait(self, seconds: float) -> int | None:
        """The marked process, waiting up to `seconds` for a mark still in a pipe."""
        self.marked.wait(seconds)
        return self.index


def _stream(
    index: int, source: IO[bytes], sink: IO[str], lock: threading.Lock, failures: _FirstFailure
) -> None:
    prefix = f"[{index}] "
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if line == FAILED_MARK:
            failures.mark(index)
            continue
        with lock:
            sink.write(prefix + line + "\n")
            sink.flush()
    source.close()


def _stop(processes: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every live process group, then SIGKILL to what is left after `grace` (at
    once on a second Ctrl-C: an impatient user does not leave them running)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.killpg(process.pid, sig)
        deadline = time.monotonic() + grace
        with contextlib.suppress(KeyboardInterrupt):
            while time.monotonic() < deadline and any(p.poll() is None for p in processes):
                time.sleep(_POLL_SECONDS)
    for process in processes:
        process.wait()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:  # pragma: no cover
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 + (-code) if code < 0 else code


def launch(
    count: int,
    script: str,
    args: Sequence[str] = (),
    *,
    port: int | None = None,
    failure_timeout: int = DEFAULT_FAILURE_TIMEOUT,
    grace: float = 5.0,
    out: IO[str] | None = None,
) -> int:
    """Runs `python script args...` in `count` local processes under `jax.distributed`.

    Args:
        count: The number of processes (>= 1).
        script: The Python file to run.
        args: Its command-line arguments.
        port: The coordinator's port on 127.0.0.1 (default: a free one).
        failure_timeout: Seconds after which jax reports a process that stopped
            responding (its heartbeat), for processes the launcher cannot see die.
        grace: Seconds between SIGTERM and SIGKILL when stopping the others.
        out: Where the prefixed output goes (default: sys.stdout).

    Returns:
        0 if every process succeeded, else the exit code of the first that failed
        (128 + signal number for a process killed by a signal).

    Example:
        >>> import io, os, tempfile
        >>> script = os.path.join(tempfile.mkdtemp(), "hello.py")
        >>> _ = open(script, "w").write(
        ...     "import sys, fuseloop, jax\\n"
        ...     "print(jax.process_index(), 'of', jax.process_count(), sys.argv[1:])\\n")
        >>> out = io.StringIO()
        >>> launch(2, script, ["--epochs", "3"], out=out)
        0
        >>> sorted(out.getvalue().splitlines())
        ["[0] 0 of 2 ['--epochs', '3']", "[1] 1 of 2 ['--epochs', '3']"]
    """
    _check_launch_arguments(count, script, grace)
    _check_coordination(port, failure_timeout)
    sink = out or sys.stdout
    address = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()
    processes: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    failures = _FirstFailure()
    previous = _stop_on_sigterm()
    try:
        for index in range(count):
            process = _spawn(script, args, _environment(index, count, address, failure_timeout))
            processes.append(process)
            readers.append(_start_reader(index, process, sink, lock, failures))
        code = _watch(processes, sink, lock, grace, failures)
    except BaseException:
        _stop(processes, grace)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    for reader in readers:
        reader.join()
    return code


def _stop_on_sigterm() -> Any:
    """SIGTERM (what `timeout`, SLURM and `docker stop` send) ends the launch as Ctrl-C
    does: the processes, in sessions of their own, are stopped rather than left running.
    Returns the handler it replaced (None off the main thread, where none is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, terminated)


_MAX_TIMEOUT = 10**8  # seconds (three years): jax's coordinator takes a C int of them


def _check_coordination(port: int | None, failure_timeout: int) -> None:
    if port is not None and (not is_int(port) or not 1 <= port <= 65535):
        raise ValueError(f"port={port!r} must be a TCP port, 1 to 65535")
    if not is_int(failure_timeout) or not 1 <= failure_timeout <= _MAX_TIMEOUT:
        raise ValueError(
            f"failure_timeout={failure_timeout!r} must be a whole number of seconds, 1 to "
            f"{_MAX_TIMEOUT}"
        )
    if port is not None:  # the coordinator binds it in process 0: said here, not there
        with socket.socket() as probe:
            # As the coordinator binds: a port left in TIME_WAIT by the last launch is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as error:
                raise ValueError(
                    f"port={port} cannot be bound here ({error.strerror or error}): choose "
                    f"another, or leave it out for a free one"
                ) from None


_PER_CORE = 8  # local processes per CPU core, at most


def _check_launch_arguments(count: int, script: str, grace: float) -> None:
    if not is_int(count) or count < 1:
        raise ValueError(f"count={count!r} must be a positive int (the number of processes)")
    cores = os.cpu_count() or 1
    if count > _PER_CORE * cores:  # a typo's thousand JAX processes would swamp the machine
        raise ValueError(
            f"count={count} is more than {_PER_CORE} processes per CPU core (this machine has "
            f"{cores} CPU cores): each is a Python process with its own JAX runtime. Pass at most "
            f"{_PER_CORE * cores}, or run on more machines"
        )
    if not grace >= 0:
        raise ValueError(f"grace={grace!r} must be a number of seconds >= 0")
    if not os.path.isfile(script):
        raise ValueError(f"script={script!r} is not a file")


def _spawn(script: str, args: Sequence[str], env: dict) -> subprocess.Popen:
    """`python script args...`, its output piped, in a session of its own (so that `_stop`
    signals its whole process group)."""
    return subprocess.Popen(
        [sys.executable, script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )


def _start_reader(
    index: int,
    process: subprocess.Popen,
    sink: IO[str],
    lock: threading.Lock,
    failures: _FirstFailure,
) -> threading.Thread:
    """A started thread that copies the process's output to `sink`, line by line."""
    reader = threading.Thread(
        target=_stream, args=(index, process.stdout, sink, lock, failures), daemon=True
    )
    reader.start()
    return reader


def _watch(
    processes: list[subprocess.Popen],
    sink: IO[str],
    lock: threading.Lock,
    grace: float,
    failures: _FirstFailure,
) -> int:
    """Waits for every process; on the first failure stops the rest and returns its code.

    Each process is waited for by a thread of its own, so exits are seen in the order they
    happened. When one process fails, the others soon fail too (their collectives lose a
    peer) and may even exit first, while the failed one is still tearing down: a process
    whose uncaught exception ended it marks that in its output before exiting
    (`FAILED_MARK`), and the first mark names the process.
    """
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for index, process in enumerate(processes):
        threading.Thread(
            target=lambda i=index, p=process: exits.put((i, p.wait())), daemon=True
        ).start()
    for _ in processes:
        while True:  # a timed wait, so that a signal to the launcher is handled at once
            try:
                index, code = exits.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                continue
        if code != 0:
            marked = failures.wait(_MARK_SECONDS)  # the one whose exception came first
            if marked is not None and marked != index:
                index, code = marked, 1
            with lock:
                sink.write(
                    f"[launch] process {index} {_describe(code)}; stopping the other processes\n"
                )
                sink.flush()
            _stop(processes, grace)
            return _exit_code(code)
    return 0
