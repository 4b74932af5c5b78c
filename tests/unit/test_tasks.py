"""TaskSupervisor: which ends of a task fail the service, and that the first failure is the one reported."""

from __future__ import annotations

import asyncio

from llmserve.runtime.tasks import TaskEnded, TaskSupervisor


async def _forever() -> None:
    await asyncio.Event().wait()


async def _raise(exc: BaseException) -> None:
    await asyncio.sleep(0)
    raise exc


async def _return() -> None:
    await asyncio.sleep(0)


def _run(scenario) -> list[BaseException]:
    failures: list[BaseException] = []

    async def main() -> None:
        tasks = TaskSupervisor(on_failure=failures.append)
        await scenario(tasks)
        await tasks.cancel_all()

    asyncio.run(main())
    return failures


def test_a_task_that_raises_fails_the_service_once_with_its_error():
    boom, later = ValueError("boom"), KeyError("later")

    async def scenario(tasks: TaskSupervisor) -> None:
        tasks.start("heartbeat", _forever())
        tasks.start("engine-loop", _raise(boom))
        await asyncio.sleep(0.01)
        tasks.start("stats", _raise(later))
        await asyncio.sleep(0.01)
        assert tasks.failure is boom
        assert tasks.names() == ["heartbeat"]

    assert _run(scenario) == [boom]


def test_a_task_that_returns_unasked_fails_unless_it_may():
    async def scenario(tasks: TaskSupervisor) -> None:
        tasks.start("reader", _return(), may_return=True)
        await asyncio.sleep(0.01)
        assert tasks.failure is None
        tasks.start("engine-loop", _return())
        await asyncio.sleep(0.01)

    failures = _run(scenario)
    assert len(failures) == 1 and isinstance(failures[0], TaskEnded) and "engine-loop" in str(failures[0])


def test_cancel_and_ends_while_stopping_are_expected():
    async def scenario(tasks: TaskSupervisor) -> None:
        tasks.start("heartbeat", _forever())
        await tasks.cancel("heartbeat")
        assert "heartbeat" not in tasks
        tasks.start("engine-loop", _return())
        tasks.start("stats", _raise(RuntimeError("while draining")))
        tasks.stopping = True
        await asyncio.sleep(0.01)

    assert _run(scenario) == []


def test_cancel_asks_again_when_a_library_swallowed_the_cancel():
    """Python 3.11's wait_for (which redis-py sends every command through) drops a cancel that meets
    a finishing awaitable; a loop around it would then run on and its service never exit."""
    swallowed = []

    async def loop_that_loses_one_cancel() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)      # what the library did: carry on as if nothing came

    async def scenario(tasks: TaskSupervisor) -> None:
        tasks.start("stats", loop_that_loses_one_cancel())
        await asyncio.sleep(0)
        async with asyncio.timeout(10):
            await tasks.cancel("stats")
        assert "stats" not in tasks and swallowed == [True]

    assert _run(scenario) == []
