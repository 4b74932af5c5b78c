"""The thread engine steps run on, and how long the current one has been running.

A daemon thread of its own rather than a ThreadPoolExecutor: the interpreter joins an
executor's threads at exit, so one hung step (a kernel that never returns) would keep a
failed worker from ever exiting; a daemon thread is left behind. The OS thread carries the
name too (`top -H`, py-spy, gdb), so an operator can find a stuck step.
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_PR_SET_NAME = 15


def _name_os_thread(name: str) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class StepThread:
    """Runs one callable at a time, in submission order, on a daemon thread named `name`."""

    def __init__(self, name: str = "engine-step") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started_at: float | None = None   # time.monotonic() the running job started
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def running_for(self) -> float:
        """Seconds the job in hand has been running (0.0 when idle)."""
        started = self._started_at
        return 0.0 if started is None else time.monotonic() - started

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue `fn`; the future (of the running loop) gets its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn))
        return future

    def close(self, wait: bool = True) -> None:
        """Stop after the queued jobs; `wait=False` leaves a hung job behind."""
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        _name_os_thread(self.name)
        while (job := self._jobs.get()) is not None:
            loop, future, fn = job
            self._started_at = time.monotonic()
            try:
                outcome: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                outcome = (None, exc)
            finally:
                self._started_at = None
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:           # the loop closed meanwhile: nobody waits for it
                pass


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():                      # the awaiting task was cancelled
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
