"""The pool of tokenizer processes, seen from the asyncio front.

    submit() ─▶ Job ─▶ Dispatcher.choose() ─▶ PoolWorker.send() ──socket──▶ pool process
                                                  ▲                               │
                      future.set_result() ◀─ _read_loop() ◀──────── Result ───────┘

A process that dies (EOF on its socket) is replaced; each of its in-flight jobs is
sent once more to a live process (or waits in the backlog for the replacement);
a job that was running when a second process died fails UNAVAILABLE (a request
that kills processes must not kill the whole pool).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from llmserve.runtime.errors import DeadlineExceeded, InvalidArgument, Unavailable
from llmserve.runtime.tasks import TaskSupervisor
from tokenizer_svc import metrics, pool_process, protocol
from tokenizer_svc.dispatch import Dispatcher, ProcessLoad
from tokenizer_svc.loader import ModelTokenizer

logger = structlog.get_logger(__name__)

MAX_ATTEMPTS = 2          # the first dispatch and one retry
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Job:
    id: int
    op: str
    model: str
    args: tuple[Any, ...]
    cost: int
    lane: int
    deadline: float | None
    future: asyncio.Future
    attempts: int = 0

    def task(self) -> protocol.Task:
        return protocol.Task(self.id, self.op, self.model, self.args, self.lane, self.deadline)


@dataclass
class PoolWorker:
    """One pool process: its socket, what it has in flight, and its load."""

    index: int
    process: multiprocessing.process.BaseProcess
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    ready: bool = False
    pid: int = 0
    inflight: dict[int, Job] = field(default_factory=dict)
    load: ProcessLoad = field(default_factory=ProcessLoad)

    def send(self, job: Job) -> None:
        self.inflight[job.id] = job
        self.load.add(job.lane, job.cost)
        self._gauge(job.lane)
        self.writer.write(protocol.pack(job.task()))

    def finish(self, job_id: int) -> Job | None:
        job = self.inflight.pop(job_id, None)
        if job is not None:
            self.load.remove(job.lane, job.cost)
            self._gauge(job.lane)
        return job

    def _gauge(self, lane: int) -> None:
        metrics.QUEUE_DEPTH.labels(process=str(self.index), lane=_LANE_NAMES[lane]).set(self.load.count[lane])


_LANE_NAMES = {protocol.LANE_INTERACTIVE: "interactive", protocol.LANE_BULK: "bulk"}


class Pool:
    """`size` processes, each holding every model; `submit()` runs one op on the least-loaded one."""

    def __init__(self, models: dict[str, ModelTokenizer], size: int, long_text_bytes: int,
                 segment_cache_bytes: int, on_failure: Callable[[BaseException], None] = lambda _exc: None) -> None:
        """`on_failure`: called once when a process's read loop raised (a bug here): the service fails."""
        self.models = models
        self.size = size
        self.long_text_bytes = long_text_bytes
        self.segment_cache_bytes = segment_cache_bytes
        self.workers: dict[int, PoolWorker] = {}
        self.backlog: list[Job] = []
        self.dispatcher = Dispatcher()
        self.ids = itertools.count(1)
        self.closing = False
        self.crashes: dict[int, int] = {}  # index → consecutive crashes (restart backoff)
        self.tasks = TaskSupervisor(on_failure)     # one read loop per process; it ends when the process does
        self._generations = itertools.count()
        self._ready = asyncio.Event()
        self._context = multiprocessing.get_context("spawn")

    async def start(self, timeout_s: float = 120.0) -> None:
        """Spawn every process and wait until all are ready."""
        await asyncio.gather(*(self._spawn(i) for i in range(self.size)))
        async with asyncio.timeout(timeout_s):
            await self._all_ready()

    async def _all_ready(self) -> None:
        while sum(w.ready for w in self.workers.values()) < self.size:
            self._ready.clear()
            await self._ready.wait()

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values() if w.ready]

    async def submit(self, op: str, model: str, args: tuple[Any, ...], cost: int, deadline: float | None) -> Any:
        """Run `op` on a pool process; raises InvalidArgument / DeadlineExceeded / Unavailable."""
        if self.closing:
            raise Unavailable("tokenizer pool is stopping")
        lane = protocol.LANE_BULK if cost > self.long_text_bytes else protocol.LANE_INTERACTIVE
        job = Job(next(self.ids), op, model, args, cost, lane, deadline, asyncio.get_running_loop().create_future())
        self._dispatch(job)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                return await job.future
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded while tokenizing") from None

    def _dispatch(self, job: Job) -> None:
        if job.future.done():  # its caller gave up while it waited for a process
            return
        # is_alive() reaps a killed process at once, before its socket's EOF is read: a retry must not
        # land on a process that died in the same incident.
        ready = [w for w in self.workers.values() if w.ready and w.process.is_alive()]
        if not ready:
            self.backlog.append(job)
            return
        job.attempts += 1
        ready[self.dispatcher.choose([w.load for w in ready], job.lane)].send(job)

    # ------------------------------------------------------------------------------ processes

    async def _spawn(self, index: int) -> None:
        parent_sock, child_sock = socket.socketpair()
        process = self._context.Process(target=pool_process.main, name=f"tokenizer-pool-{index}", daemon=True,
                                        args=(child_sock, self.models, self.segment_cache_bytes))
        await asyncio.get_running_loop().run_in_executor(None, process.start)
        child_sock.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent_sock)
        worker = PoolWorker(index, process, reader, writer)
        self.workers[index] = worker
        self.tasks.start(f"pool-read-{index}.{next(self._generations)}", self._read_loop(worker), may_return=True)

    async def _read_loop(self, worker: PoolWorker) -> None:
        try:
            while True:
                header = await worker.reader.readexactly(protocol.HEADER.size)
                body = await worker.reader.readexactly(protocol.HEADER.unpack(header)[0])
                self._on_message(worker, protocol.unpack(body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        await self._on_exit(worker)

    def _on_message(self, worker: PoolWorker, message: Any) -> None:
        if isinstance(message, protocol.Ready):
            worker.ready, worker.pid = True, message.pid
            self.crashes.pop(worker.index, None)
            metrics.POOL_PROCESSES.set(len(self.pids()))
            logger.info("pool process ready", process=worker.index, pid=message.pid)
            self._ready.set()
            backlog, self.backlog = self.backlog, []
            for job in backlog:
                self._dispatch(job)
            return
        finished = worker.finish(message.job_id)
        if finished is not None:
            _record_cache(message)
            _deliver(finished, message)

    async def _on_exit(self, worker: PoolWorker) -> None:
        worker.ready = False
        worker.writer.close()
        metrics.POOL_PROCESSES.set(len(self.pids()))
        jobs = _unfinished(worker)
        await asyncio.get_running_loop().run_in_executor(None, worker.process.join, 5.0)  # reap it first
        if self.closing:
            _fail(jobs, Unavailable("tokenizer pool stopped"))
            return
        logger.warning("pool process died; replacing it", process=worker.index, pid=worker.pid,
                       exitcode=worker.process.exitcode, inflight=len(jobs))
        metrics.RESTARTS.inc()
        self._retry(jobs)
        crashes = self.crashes[worker.index] = self.crashes.get(worker.index, 0) + 1
        await asyncio.sleep(RESTART_BACKOFF_S[min(crashes, len(RESTART_BACKOFF_S)) - 1])
        if not self.closing:
            await self._spawn(worker.index)

    def _retry(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.future.done():
                continue
            if job.attempts >= MAX_ATTEMPTS:
                job.future.set_exception(Unavailable("tokenizer pool process died twice while running this request"))
                continue
            metrics.RETRIES.inc()
            self._dispatch(job)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close every socket (each process finishes its queue and exits), then reap them."""
        self.closing = True
        self.tasks.stopping = True
        _fail(self.backlog, Unavailable("tokenizer pool stopped"))
        self.backlog = []
        workers = list(self.workers.values())
        for worker in workers:
            _half_close(worker.writer)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, w.process.join, timeout_s) for w in workers))
        for worker in workers:
            if worker.process.is_alive():
                worker.process.kill()
        if readers := [self.tasks[name] for name in self.tasks.names()]:
            await asyncio.wait(readers, timeout=timeout_s)


def _unfinished(worker: PoolWorker) -> list[Job]:
    """Take a dead process's in-flight jobs back. Each lane runs its tasks in the order sent, so
    only the oldest job of each lane can have been running (and may have caused the crash); the
    ones queued behind it get their attempt back, so a process dying for an unrelated reason
    (killed together with another one) does not use up their retry."""
    jobs = list(worker.inflight.values())  # dispatch order
    running = {next((j.id for j in jobs if j.lane == lane), None) for lane in protocol.LANES}
    for job in jobs:
        worker.finish(job.id)
        if job.id not in running:
            job.attempts -= 1
    return jobs


def _half_close(writer: asyncio.StreamWriter) -> None:
    """EOF to the process (it finishes what it has, answers, and exits); the read side stays open."""
    try:
        writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


def _record_cache(result: protocol.Result) -> None:
    if result.cache_hits:
        metrics.CACHE_LOOKUPS.labels(cache="segment", result="hit").inc(result.cache_hits)
    if result.cache_misses:
        metrics.CACHE_LOOKUPS.labels(cache="segment", result="miss").inc(result.cache_misses)


def _deliver(job: Job, result: protocol.Result) -> None:
    if job.future.done():  # the caller gave up (deadline, cancellation)
        return
    if result.error is None:
        job.future.set_result(result.value)
        return
    kind, field_name, message = result.error
    if kind == protocol.ERR_INVALID:
        job.future.set_exception(InvalidArgument(field_name, message))
    elif kind == protocol.ERR_DEADLINE:
        job.future.set_exception(DeadlineExceeded(message))
    else:
        job.future.set_exception(RuntimeError(f"pool process failed on {job.op}: {message}"))


def _fail(jobs: list[Job], exc: Exception) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(exc)
