"""Supervised long-lived tasks: one that ends unexpectedly fails its service, loudly.

    tasks = TaskSupervisor(on_failure=service.fail)
    tasks.start("heartbeat", heartbeat.run())           # must run until stopped
    tasks.start("read-0", read_loop(), may_return=True)  # may end; an exception still fails
    ...
    tasks.stopping = True      # drain: ends from here on are expected
    await tasks.cancel("heartbeat")
    await tasks.cancel_all()

A task that raises, or returns while it must not, is logged with its stack and handed to
`on_failure` once (the first failure wins); the service then sets `failure` and its stop
event, and `llmserve.runtime.server.serve` turns health NOT_SERVING and exits 1, so the supervisor
(`llmserve up`, Kubernetes) replaces the process instead of it running on without the task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

logger = structlog.get_logger(__name__)
# Python 3.11's asyncio.wait_for returns its result instead of raising when a cancel arrives as
# its awaitable finishes; redis-py sends every command through it (socket_timeout), so a cancel
# can be lost and a task cancelled once may run on. cancel() asks again after this long.
RECANCEL_S = 0.5


class TaskEnded(RuntimeError):
    """A task that must run until stopped returned."""


class TaskSupervisor:
    """Named tasks of one service.

    Args:
        on_failure: called (on the event loop, once) with the first unexpected end's exception.
    """

    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        self.on_failure = on_failure
        self.stopping = False
        self.failure: BaseException | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._may_return: set[str] = set()

    def start(self, name: str, coro: Coroutine[Any, Any, Any], *, may_return: bool = False) -> asyncio.Task:
        """Run `coro` as the task `name` (a name not running yet)."""
        assert name not in self._tasks, f"task {name} already runs"
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        if may_return:
            self._may_return.add(name)
        task.add_done_callback(self._ended)
        return task

    def __getitem__(self, name: str) -> asyncio.Task:
        return self._tasks[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tasks

    def names(self) -> list[str]:
        return list(self._tasks)

    async def cancel(self, name: str) -> None:
        """Cancel the task `name` (an expected end) and wait for it."""
        task = self._tasks.get(name)
        if task is None:
            return
        await cancel_and_wait(task)
        with contextlib.suppress(asyncio.CancelledError):
            try:
                task.result()
            except Exception as exc:  # noqa: BLE001 - a failure was reported when it happened
                logger.debug("task ended with an error", task=name, error=repr(exc))

    async def cancel_all(self) -> None:
        """Stop every task (ends are expected from now on)."""
        self.stopping = True
        for name in list(self._tasks):
            await self.cancel(name)

    def _ended(self, task: asyncio.Task) -> None:
        name = task.get_name()
        self._tasks.pop(name, None)
        may_return = name in self._may_return
        self._may_return.discard(name)
        if task.cancelled():                 # only cancel() and shutdown cancel a task
            return
        exc = task.exception()
        if exc is None and not (may_return or self.stopping):
            exc = TaskEnded(f"task {name} returned without being stopped")
        if exc is None:
            return
        if self.stopping or self.failure is not None:
            logger.warning("task ended with an error while stopping", task=name, error=repr(exc))
            return
        self.failure = exc
        logger.error("task died; failing the service", task=name, exc_info=(type(exc), exc, exc.__traceback__))
        self.on_failure(exc)


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it ended, cancelling again while a library swallows it."""
    task.cancel()
    while not task.done():
        await asyncio.wait({task}, timeout=RECANCEL_S)
        if not task.done():
            logger.debug("task still running after a cancel; cancelling again", task=task.get_name())
            task.cancel()
