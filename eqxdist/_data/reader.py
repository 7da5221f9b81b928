"""The read-ahead thread behind `BatchLoader.iterate`: reads (and places) the
batches of the next steps while the consumer's step runs, never more than `depth`
ahead, and hands an exception over to the consumer instead of dying silently."""

import queue
import threading
from collections.abc import Callable
from typing import Any

# Put by `close()` so that a consumer blocked on an empty queue wakes up and ends.
_CLOSED = object()


class Reader:
    """Calls `read(step)` for `start, start + 1, ...` in a daemon thread; `next()`
    returns `(step, batch)` in order and raises the exception `read` raised."""

    def __init__(self, read: Callable[[int], Any], start: int, depth: int) -> None:
        self._read = read
        # One slot per batch read ahead; the consumer frees one per batch it takes.
        self._slots = threading.Semaphore(depth)
        self._ready: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(start,), name="BatchLoader reader", daemon=True
        )
        self._thread.start()

    def _run(self, step: int) -> None:
        while True:
            self._slots.acquire()
            if self._stop.is_set():
                return
            try:
                batch = self._read(step)
            except Exception as error:
                self._ready.put((step, None, error))
                return
            self._ready.put((step, batch, None))
            step += 1

    def next(self) -> tuple[int, Any] | None:
        """The next `(step, batch)`; `None` once the reader is closed."""
        item = None if self._stop.is_set() else self._ready.get()
        if item is None or item is _CLOSED:
            return None
        step, batch, error = item
        if error is not None:
            raise error
        self._slots.release()
        return step, batch

    def close(self) -> None:
        """Stop the thread (after the read in progress, if any) and wait for it."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._slots.release()  # wake the thread if it waits for a free slot
        self._ready.put(_CLOSED)
        self._thread.join()
