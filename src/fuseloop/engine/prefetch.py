"""A bounded background producer of fused chunks.

While the device runs chunk n, a thread pulls, checks, stacks and transfers the next chunks,
at most `depth` of them ahead. It is only used where pulling a batch that is never stepped
is harmless (docs/design.md §2, exact consumption); the loop stops it at the end of every
epoch, so no thread outlives `run`, and an exception raised by the source is re-raised in
the caller's thread with its own type and traceback.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ChunkProducer"]

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class ChunkProducer:
    """Runs `prepare(first_index)` ahead in a thread; `get()` returns chunks in order.

    `prepare(first_index)` returns a prepared chunk (with its live steps `n` and whether it
    `exhausted` the epoch) or None at the end of the epoch.
    """

    def __init__(self, prepare: Callable[[int], Any], depth: int):
        self._prepare = prepare
        self._queue: queue.Queue[Any] = queue.Queue()
        # At most `depth` chunks prepared and not yet handed out: a slot is taken before
        # a chunk is pulled and given back when the consumer takes the next one.
        self._slots = threading.Semaphore(depth)
        self._handed_out = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="fuseloop-prefetch", daemon=True)
        self._thread.start()

    def _acquire(self) -> bool:
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.05):
                return True
        return False

    def _put(self, item: Any) -> bool:
        if self._stop.is_set():
            return False
        self._queue.put(item)
        return True

    def _produce(self) -> None:
        first = 0
        try:
            while self._acquire():
                prepared = self._prepare(first)
                if prepared is None:
                    break
                if not self._put(prepared):
                    return
                first += prepared.n
                if prepared.exhausted:
                    break
        except BaseException as error:  # handed to the consumer, re-raised there
            self._put(_Failure(error))
            return
        self._put(_END)

    def get(self, first_index: int = 0) -> Any:
        """The next prepared chunk, or None when the epoch's data is exhausted.

        `first_index` is accepted for symmetry with the synchronous path (the thread keeps
        its own position).
        """
        if self._handed_out:  # the previous chunk has been dispatched: free its slot
            self._slots.release()
        item = self._queue.get()
        self._handed_out = True
        if item is _END:
            return None
        if isinstance(item, _Failure):
            raise item.error
        return item

    def stop(self, wait: bool = True) -> None:
        """Stops the thread (batches it pulled ahead are dropped) and waits for it; an
        abort (`wait=False`) does not wait for a pull under way, which may block: the
        thread ends once that pull returns (the feed then pulls nothing more)."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if wait:
            self._thread.join()
