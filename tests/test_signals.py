"""SIGINT/SIGTERM during a run: halt at the next host boundary, fire `halted`, let a
checkpoint write, restore the previous handlers; a second signal aborts at once.

Each test runs a real training script in a subprocess and signals it from here; the script
prints markers (`SLEEPING` when its data source starts a slow pull, `RESULT {...}` at the
end) that this side reads; the slow pull lasts until this side has sent its signal.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseloop as fl
from conftest import make_batches, with_compilation_cache

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

CHILD = r"""
import json, os, signal, sys, threading, time
import numpy as np
import fuseloop as fl

mode, fuse, workdir = sys.argv[1], int(sys.argv[2]) or False, sys.argv[3]
SLOW_FROM = 11          # the pull of this batch (epoch 1, iteration 3) is slow
PER_EPOCH = 8

def previous_term(signum, frame):
    print("PREVIOUS HANDLER RAN", flush=True)

signal.signal(signal.SIGTERM, previous_term)
previous_int = signal.getsignal(signal.SIGINT)
rng = np.random.default_rng(0)
batches = [(rng.normal(size=(4, 3)).astype(np.float32), rng.integers(0, 3, 4).astype(np.int32))
           for _ in range(PER_EPOCH)]
pulled = [0]

def data():
    for batch in batches:
        pulled[0] += 1
        if pulled[0] == SLOW_FROM + 1:
            print("SLEEPING", flush=True)
            if mode == "abort":
                time.sleep(60)
            else:  # slow until the parent has sent its signal (it then creates this file)
                deadline = time.monotonic() + 60
                while not os.path.exists(workdir + "/sent") and time.monotonic() < deadline:
                    time.sleep(0.01)
        yield batch

def on_halted(state):
    with open(workdir + "/halted.json", "w") as f:
        json.dump({"epoch": state.epoch, "iteration": state.iteration,
                   "step": int(state.step_state["step"])}, f)

loop = fl.trainer(fl.models.mlp([4, 3]), "sparse_categorical_cross_entropy", "sgd")
loop = loop.handle_event("halted", on_halted)
if mode == "checkpoint":
    loop = loop.checkpoint(workdir + "/ckpts")
threads = threading.active_count()
try:
    state = loop.run(data, epochs=50, fuse=fuse)
except KeyboardInterrupt as error:
    print("ABORTED " + json.dumps({
        "message": str(error), "pulled": pulled[0],
        "int_restored": signal.getsignal(signal.SIGINT) is previous_int,
        "term_restored": signal.getsignal(signal.SIGTERM) is previous_term}), flush=True)
    sys.exit(3)
print("RESULT " + json.dumps({
    "status": state.status, "epoch": state.epoch, "iteration": state.iteration,
    "step": int(state.step_state["step"]), "pulled": pulled[0],
    "counts": state.event_counts, "signal": state.stats.get("signal"),
    "int_restored": signal.getsignal(signal.SIGINT) is previous_int,
    "term_restored": signal.getsignal(signal.SIGTERM) is previous_term,
    "threads_before": threads, "threads_after": threading.active_count()}), flush=True)
"""


class Child:
    """The training script in a subprocess, with its output read line by line."""

    def __init__(self, mode: str, fuse: int, workdir: Path):
        env = with_compilation_cache(
            {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode, str(fuse), str(workdir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("")  # end of output

    def wait_for(self, prefix: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            self.seen.append(line)
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if line == "" and self.proc.poll() is not None:
                raise AssertionError(f"no {prefix!r} line; output:\n" + "\n".join(self.seen))

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def finish(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def run_and_signal(mode: str, fuse: int, signum: int, workdir: Path) -> tuple[Any, Child]:
    child = Child(mode, fuse, workdir)
    try:
        child.wait_for("SLEEPING")  # mid-epoch: the data source is inside a slow pull
        child.send(signum)
        (workdir / "sent").touch()  # the pull may return once the signal is delivered
        result = json.loads(child.wait_for("RESULT"))
        assert child.finish() == 0, "\n".join(child.seen)
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
    return result, child


@pytest.mark.parametrize(
    "signum, fuse",
    [(signal.SIGTERM, 0), (signal.SIGINT, 4)],
    ids=["SIGTERM-unfused", "SIGINT-fused"],
)
def test_signal_halts_at_the_next_host_boundary(tmp_path, signum, fuse):
    result, child = run_and_signal("halt", fuse, signum, tmp_path)
    assert result["status"] == "halted" and result["signal"] == signal.Signals(signum).name
    assert result["counts"]["halted"] == 1 and result["counts"]["completed"] == 0
    # Halted in epoch 1, where the signal arrived; the epoch did not complete.
    assert result["epoch"] == 1 and result["counts"]["epoch_completed"] == 1
    # The step in flight finished (unfused: the batch being pulled; fused: its chunk of 4),
    # then the loop stopped: epoch 0's 8 steps plus 4. Unfused, nothing was pulled and left
    # unstepped; fused, a re-iterable source may have been read ahead.
    assert result["step"] == 12
    assert result["pulled"] == 12 if fuse == 0 else result["pulled"] >= 12
    halted = json.loads((tmp_path / "halted.json").read_text())
    assert halted == {"epoch": 1, "iteration": result["iteration"], "step": result["step"]}
    assert result["int_restored"] and result["term_restored"]
    assert result["threads_after"] == result["threads_before"]
    assert not any("PREVIOUS HANDLER RAN" in line for line in child.seen)


@pytest.mark.parametrize("fuse", [0, 4])
def test_second_signal_aborts_at_once(tmp_path, fuse):
    # Fused, the slow pull is the prefetch thread's: the abort must neither wait for it nor
    # try to close the generator it is still inside.
    child = Child("abort", fuse, tmp_path)
    try:
        child.wait_for("SLEEPING")  # the pull now sleeps 60 s: no host boundary comes soon
        child.send(signal.SIGINT)
        time.sleep(0.5)
        assert child.proc.poll() is None, "the first signal must not abort"
        child.send(signal.SIGINT)
        aborted = json.loads(child.wait_for("ABORTED", timeout=30))
        assert child.finish(timeout=30) == 3
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
    assert "second SIGINT" in aborted["message"]
    assert aborted["int_restored"] and aborted["term_restored"]
    assert not (tmp_path / "halted.json").exists()


def _checkpoints_work() -> bool:
    try:
        fl.save_state  # noqa: B018
        from fuseloop.handlers.checkpoint import Checkpointer  # noqa: F401
    except (AttributeError, ImportError):
        return False
    return True


@pytest.mark.skipif(not _checkpoints_work(), reason="Loop.checkpoint is not available")
def test_signal_lets_an_attached_checkpoint_write_the_final_state(tmp_path):
    result, _ = run_and_signal("checkpoint", 0, signal.SIGTERM, tmp_path)
    assert result["status"] == "halted"
    saved = fl.load_state(tmp_path / "ckpts")  # the latest complete checkpoint
    assert int(saved.step_state["step"]) == result["step"]
    assert saved.epoch == result["epoch"]
    assert saved.stats.get("signal") == "SIGTERM"  # a restarted notebook can tell why


@pytest.mark.parametrize("event", ["completed", "halted"])
def test_a_signal_during_the_final_handlers_is_named_in_the_stats(event):
    """The stats name a signal as it arrives: one during the run's last handlers (its final
    checkpoint) was named, and the State that handlers at `halted` saw named one before."""
    seen = []

    def signal_now(state: fl.State) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # SIGINT: a missing guard fails the test
        seen.append(state.stats.get("signal"))

    loop = fl.trainer(fl.models.mlp([4, 3]), "sparse_categorical_cross_entropy", "adam")
    loop = loop.handle_event(event, signal_now)
    if event == "halted":
        loop = loop.handle_event("epoch_completed", lambda s: "halt_loop")
    state = loop.run(make_batches(4), epochs=2)
    assert state.status == event and state.stats["signal"] == "SIGINT"
    assert seen == ["SIGINT"]


@pytest.mark.parametrize("fuse", [False, 20, 32, "run"])
def test_a_signal_in_an_epoch_handler_halts_before_the_next_epoch_on_resident_data(fuse):
    """Resident data with `fuse=32` or "run" runs several epochs per dispatch: a signal in
    epoch 1's `epoch_completed` handler halts there, as the per-epoch and unfused runs do,
    rather than after training epoch 2 (in-process; SIGINT, so a missing guard fails the
    test with KeyboardInterrupt instead of killing the worker)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 4)).astype(np.float32)
    y = rng.integers(0, 3, 320).astype(np.int32)
    events: list[tuple[str, int, int]] = []

    def signal_at_epoch_1(state: fl.State) -> None:
        if state.epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)

    loop = fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "adam")
    loop = loop.handle_event("epoch_completed", signal_at_epoch_1)
    for event in ("epoch_started", "epoch_completed", "epoch_halted", "halted", "completed"):
        loop = loop.observe(event, lambda s, e=event: events.append((e, s.epoch, s.iteration)))
    state = loop.run(fl.data.arrays(x, y, 16, device=True), epochs=5, fuse=fuse)
    assert (state.status, state.epoch, state.iteration) == ("halted", 1, 19)
    assert int(state.step_state["step"]) == 40 and sorted(state.history) == [0, 1]
    assert events[-2:] == [("epoch_completed", 1, 19), ("halted", 1, 19)]
    assert ("epoch_started", 2, 0) not in events


def test_under_an_abort_guard_a_first_signal_stops_the_program_not_one_run(monkeypatch):
    """The benchmark's runs used to halt on a Ctrl-C and the benchmark went on to the next
    system; under `AbortOnSignal` (the bench's outermost guard) the first signal raises."""
    from fuseloop import cli
    from fuseloop.engine.signals import AbortOnSignal

    def interrupt(state: fl.State) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(4, 3)).astype(np.float32), rng.integers(0, 3, 4).astype(np.int32))
        for _ in range(4)
    ]
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    loop = loop.observe("epoch_completed", interrupt)
    # What was there before (a shell that starts pytest in the background ignores SIGINT).
    before = signal.getsignal(signal.SIGINT)
    assert loop.run(batches, epochs=3).status == "halted"  # a run alone halts gracefully
    with pytest.raises(KeyboardInterrupt, match="SIGINT"), AbortOnSignal():
        loop.run(batches, epochs=3)
    assert signal.getsignal(signal.SIGINT) is before  # restored

    def bench_main(argv):
        raise KeyboardInterrupt("SIGINT: stopped")

    monkeypatch.setattr("fuseloop.bench.main", bench_main)
    assert cli.main(["bench", "--quick"]) == 130


def _signalling_source(x: np.ndarray, y: np.ndarray, batch: int, at_epoch: list[int]):
    """Batches of (x, y); in epoch `at_epoch[0]` a SIGINT arrives once the last batch is
    handed out (while its step runs): the epoch has every step it needs."""
    epoch = [-1]

    def batches():
        epoch[0] += 1
        for i in range(0, len(x), batch):
            yield x[i : i + batch], y[i : i + batch]
        if epoch[0] == at_epoch[0]:
            os.kill(os.getpid(), signal.SIGINT)

    return batches


@pytest.mark.parametrize("fuse", [False, 3])
def test_a_signal_after_an_epochs_last_batch_completes_that_epoch(fuse):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 3)).astype(np.float32)
    y = rng.integers(0, 3, 24).astype(np.int32)
    at = [1]
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "adam")
    completed: list[int] = []
    loop = loop.observe("epoch_completed", lambda s: completed.append(s.epoch))
    halted = loop.run(_signalling_source(x, y, 4, at), epochs=4, fuse=fuse)
    assert halted.status == "halted" and sorted(halted.history) == [0, 1] == completed
    at[0] = -1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: it resumes from an epoch's end
        resumed = loop.run(_signalling_source(x, y, 4, at), halted, epochs=4, fuse=fuse)
    whole = loop.run(_signalling_source(x, y, 4, at), epochs=4, fuse=fuse)
    assert resumed.history == whole.history
    assert int(resumed.step_state["step"]) == int(whole.step_state["step"]) == 24


class _SignallingIterator:
    """A one-shot iterator without `close()`: a SIGINT arrives as its 6th batch is pulled."""

    def __init__(self, batches: list[Any]):
        self.batches, self.pulled = iter(batches), 0

    def __iter__(self) -> _SignallingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        self.pulled += 1
        if self.pulled == 6:
            os.kill(os.getpid(), signal.SIGINT)
        return batch


@pytest.mark.parametrize("fuse", [False, 4])
def test_batches_a_signal_leaves_pulled_ahead_from_an_iterator_are_warned_of(fuse):
    # A fused run pulls the next chunks' batches ahead; the signal's halt dropped them in
    # silence, so a later run over the iterator started after them.
    source = _SignallingIterator(make_batches(24))
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = loop.run(source, epochs=1, fuse=fuse)
    lost = source.pulled - int(state.step_state["step"])
    held = [str(w.message) for w in caught if "did not step" in str(w.message)]
    assert state.status == "halted" and (lost == 0 or fuse)
    # Whatever the threads' timing, a warning says exactly what was lost (a fused run
    # usually loses a chunk or two: 8 of 12 here when measured).
    said = [f"data: the run ended holding {lost} batch{'es' if lost > 1 else ''}"] if lost else []
    assert [message[: len(said[0])] for message in held] == said if said else not held


def test_a_run_in_another_thread_leaves_the_main_threads_run_its_signals():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 3)).astype(np.float32)
    y = rng.integers(0, 3, 24).astype(np.int32)
    loop = fl.trainer(fl.models.mlp([3]), "sparse_categorical_cross_entropy", "sgd")
    inside, release = threading.Event(), threading.Event()

    def hold(state: fl.State) -> None:  # keeps the background run going until released
        inside.set()
        release.wait(60)

    background = threading.Thread(
        target=lambda: loop.observe("epoch_started", hold).run([(x, y)], epochs=1)
    )
    background.start()
    try:
        assert inside.wait(60)
        state = loop.run(_signalling_source(x, y, 4, [0]), epochs=3, fuse=3)
    finally:
        release.set()
        background.join(60)
    assert state.status == "halted" and sorted(state.history) == [0]


def test_a_second_signal_aborts_while_the_host_waits_for_a_long_dispatch():
    from fuseloop.engine.signals import SignalGuard, wait_interruptibly

    @jax.jit
    def slow(a):  # seconds of device work, in one dispatch (as a whole run's)
        return jax.lax.fori_loop(0, 4000, lambda i, m: jnp.tanh(m @ m), a)

    a = jnp.eye(192) * 0.5
    slow(a).block_until_ready()  # compiled
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (0.05, 0.15)]
    out = None
    with pytest.raises(KeyboardInterrupt, match="second SIGINT"), SignalGuard() as guard:
        out = slow(a)
        for timer in timers:
            timer.start()
        wait_interruptibly(out)
    assert guard.requested and out is not None and not out.is_ready()  # the device still works
    out.block_until_ready()


def _sources(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)]
    return {
        "list": lambda: batches,
        "arrays": lambda: fl.data.arrays(x, y, batch_size=8, seed=1),
        "one_shot": lambda: iter(batches * 3),  # consumed across epochs: never pulled ahead
    }


@pytest.mark.parametrize("source", ["list", "arrays", "one_shot"])
def test_a_signal_right_after_an_epochs_last_step_ends_it_alike_fused_and_unfused(source):
    # Ctrl-C in the last step's iteration_completed: no batch is pulled after it yet. A
    # list or fl.data.arrays says how many batches an epoch has, so its last step is known
    # to be the last, and the epoch completes; of a one-shot iterator only the next pull
    # would tell (never made, to consume exactly), so both cut the epoch short.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(56, 5)).astype(np.float32)
    y = rng.integers(0, 3, 56).astype(np.int32)

    def run(fuse: Any) -> tuple[Any, ...]:
        completed: list[int] = []
        loop = fl.trainer(fl.models.mlp([8, 3]), "sparse_categorical_cross_entropy", "adam")
        loop = loop.observe("epoch_completed", lambda s: completed.append(s.epoch))
        interrupt = lambda s: os.kill(os.getpid(), signal.SIGINT)  # noqa: E731
        loop = loop.observe("iteration_completed", interrupt, filter={"once": 7})
        state = loop.run(_sources(x, y)[source](), epochs=3, fuse=fuse)
        return state.status, sorted(state.history), completed

    unfused = run(False)
    assert unfused == run(3)
    ended = [] if source == "one_shot" else [0]
    assert unfused == ("halted", ended, ended)
