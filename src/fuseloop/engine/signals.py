"""SIGINT/SIGTERM during a run become a `halt_loop` at the next host boundary."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import jax

__all__ = ["SignalGuard", "AbortOnSignal", "wait_interruptibly"]

_SIGNALS = (int(signal.SIGINT), int(signal.SIGTERM))
# `signal.signal` converts its arguments and its result to and from enums, and converting
# a Python handler back raises and catches an error inside: about 2.5 us a call, four calls
# a run. `signal.signal` is a wrapper of the interpreter's own `_signal.signal`, which takes
# and returns plain ints and handlers (the same installation, without the conversion).
_install: Any = getattr(signal, "_signal", signal).signal
_outermost: SignalGuard | None = None


class SignalGuard:
    """Installs handlers for the duration of a run and restores the previous ones.

    The first signal sets `requested`; the loop halts at its next host boundary (an
    attached checkpoint handler still writes). A second signal aborts at once with
    KeyboardInterrupt. Outside the main thread, signals cannot be caught and the guard
    does nothing.
    """

    def __init__(self, stats: dict[str, Any] | None = None) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        # The run's stats, which name the signal as it arrives: what a halted State (and
        # the checkpoint its `halted` handlers write) says stopped it, for an exit status.
        self._stats = stats

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            self._restore()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: aborting the run")
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if self._stats is not None:
            self._stats["signal"] = self.signal_name

    def __enter__(self) -> SignalGuard:
        global _outermost
        if _outermost is not None or threading.current_thread() is not threading.main_thread():
            # A run inside a run (validation): the outer run's guard owns the signals and
            # halts the outer loop; the inner run completes. Outside the main thread no
            # handler can be installed, and a run there must not take the place of the
            # main thread's run (which would then install none either).
            return self
        _outermost = self
        for signum in _SIGNALS:
            self._previous[signum] = _install(signum, self._handle)
        return self

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            _install(signum, previous)
        self._previous.clear()

    def __exit__(self, *exc: Any) -> None:
        global _outermost
        self._restore()
        if _outermost is self:
            _outermost = None


class AbortOnSignal(SignalGuard):
    """The outermost guard of a program whose runs have nothing to save on a signal (the
    benchmark): the first SIGINT/SIGTERM raises KeyboardInterrupt at once, so it stops the
    whole program rather than halting one run and going on to the next.
    """

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._restore()
        raise KeyboardInterrupt(f"{signal.Signals(signum).name}: stopped")


def wait_interruptibly(tree: Any) -> None:
    """Waits until every array of `tree` is computed, letting the main thread's signal
    handlers run meanwhile. A host read waits inside XLA, where Python runs no handler
    until the read returns: over a dispatch of many epochs (`fuse="run"`) a second Ctrl-C
    would not abort until the whole run ended. Here the main thread sleeps between checks
    (a signal's handler runs in the sleep, and the second one's KeyboardInterrupt
    propagates from it); each sleep is a fiftieth of the wait so far (0.05 to 5 ms), so the
    wait ends at most 2% (or 0.05 ms) after the device. No thread waits instead: one left
    blocked inside XLA by the interrupt would abort the interpreter at its exit.
    """
    if threading.current_thread() is not threading.main_thread() or _outermost is None:
        return  # no handler of ours to run
    leaves = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    began = time.perf_counter()
    while not all(leaf.is_ready() for leaf in leaves):  # type: ignore[attr-defined]
        time.sleep(min(max((time.perf_counter() - began) / 50, 0.00005), 0.005))
