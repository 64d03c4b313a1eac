"""A background thread that keeps the next batches ready, so the step never waits on the loader.

The wrapped iterator runs ahead; the checkpoint must still record where the *training loop* is,
so every batch travels with the iterator's state right after it, and `state_dict()` answers the
state after the last batch handed out, never one the thread has read ahead.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class Prefetcher:
    def __init__(self, inner, depth: int):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.inner = inner
        self.depth = depth
        self._state = inner.state_dict()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                self._put((next(self.inner), self.inner.state_dict()))
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it where a direct read would have
            self._put(e)

    def _put(self, item: Any) -> None:
        """Queue `item` once there is room, or give up when closed (a full queue nobody reads must not
        keep the thread alive past close())."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def __iter__(self):
        return self

    def __next__(self):
        if self._thread is None:  # started lazily: a resume loads the state before the first read
            self._queue = queue.Queue(self.depth)
            self._thread = threading.Thread(target=self._fill, name="eqtrain-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self._state = item
        return batch

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("load_state_dict after the prefetch thread started")
        self.inner.load_state_dict(state)
        self._state = self.inner.state_dict()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
