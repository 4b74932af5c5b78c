"""The batcher as a `llmserve.runtime.server.Service`: one batch loop per model and queue cell.

The gRPC server only carries health and reflection (an operator or the stack
launcher waits for SERVING); all real work happens against Redis.

Its tasks (a batch loop per cell, which also reclaims, and the stats loop) are supervised
(llmserve/runtime/tasks.py): one that ends unexpectedly fails the batcher (NOT_SERVING, exit 1) for
its supervisor to replace it. Started before Redis is reachable, it waits for it (redis_wait_s).
"""

from __future__ import annotations

import asyncio
import functools
from typing import cast

import grpc
import structlog

from batcher import metrics
from batcher.config import BatcherSettings
from batcher.model_batcher import ModelBatcher
from batcher.scripts import Scripts
from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.runtime.clock import now_ms
from llmserve.runtime.tasks import TaskSupervisor

logger = structlog.get_logger(__name__)


class BatcherService:
    """Starts a `ModelBatcher` per configured model and queue cell (`queue_shards` of them) and
    stops them gracefully.

    Args:
        settings: validated batcher settings.
        redis: a client to use instead of connecting to `settings.redis_url` (tests).
        stop: the event `serve()` waits on; set (with `failure`) when a batch loop died.
    """

    service_names: tuple[str, ...] = ()

    def __init__(self, settings: BatcherSettings, redis: redis_client.AnyRedis | None = None,
                 stop: asyncio.Event | None = None) -> None:
        self.settings = settings
        self.stop_event = stop
        self.failure: BaseException | None = None
        self.consumer = settings.consumer_name()
        self._redis = redis
        self._own_redis = redis is None
        self.cells: list[ModelBatcher] = []
        self.tasks = TaskSupervisor(on_failure=self._fail)
        self._stopping = asyncio.Event()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Nothing beyond health and reflection."""

    async def start(self) -> None:
        if self._redis is None:
            self._redis = await redis_client.connect_when_up(self.settings.redis_url, self.settings.redis_password,
                                                             wait_s=self.settings.redis_wait_s)
        scripts = Scripts(self._redis)
        await scripts.load()
        for model in self.settings.model_list():
            for shard in range(self.settings.queue_shards):
                batcher = ModelBatcher(self._redis, scripts, self.settings, model, self.consumer, shard,
                                       rehome_to=functools.partial(self._live_sibling, model, shard))
                await batcher.ensure_groups()
                self.cells.append(batcher)
                with structlog.contextvars.bound_contextvars(model=model):  # the loop's log lines carry it
                    self.tasks.start(f"batch-{model}-{shard}", batcher.run())
        self.tasks.start("batcher-stats", self._stats_loop())
        logger.info("batcher started", consumer=self.consumer, models=self.settings.model_list(),
                    queue_shards=self.settings.queue_shards,
                    limits={b.model: vars(b.limits) for b in self.cells})

    def _live_sibling(self, model: str, shard: int) -> int | None:
        """Another cell of `model` whose workers accept batches (the one with most of them), for a
        cell that has none left."""
        stamp = now_ms()
        live = {c.shard: len(c.pool.accepting(stamp)) for c in self.cells if c.model == model and c.shard != shard}
        best = max(live, key=lambda k: (live[k], -k), default=None)
        return best if best is not None and live[best] > 0 else None

    def _fail(self, exc: BaseException) -> None:
        """A task died (logged by the supervisor): serve() goes NOT_SERVING and exits 1."""
        self.failure = exc
        if self.stop_event is not None:
            self.stop_event.set()

    async def drain(self) -> None:
        """Stop reading; each loop finishes its batch in hand and flushes what it holds."""
        self.tasks.stopping = True
        for batcher in self.cells:
            batcher.stop_reading()
        self._stopping.set()
        await asyncio.gather(*(self.tasks[name] for name in self.tasks.names()), return_exceptions=True)

    async def close(self) -> None:
        await self.tasks.cancel_all()
        if self._own_redis and self._redis is not None:
            await self._redis.aclose()

    async def _stats_loop(self) -> None:
        while not self._stopping.is_set():
            for cell in self.cells:
                try:
                    await self._publish_depth(cell)
                except redis_client.ANY_ERRORS as exc:
                    logger.debug("stats refresh failed", error=repr(exc))
            try:
                async with asyncio.timeout(self.settings.stats_interval_ms / 1000):
                    await self._stopping.wait()
            except TimeoutError:
                pass

    async def _publish_depth(self, cell: ModelBatcher) -> None:
        """Depth = stream length (dispatched entries are deleted, so: unread + read-ahead); age of the oldest."""
        now = now_ms()
        shard = str(cell.shard)
        metrics.HELD.labels(cell.model, shard).set(len(cell.queue))
        for priority, stream in cell.streams.items():
            label = keys.priority_name(priority)
            metrics.QUEUE_DEPTH.labels(cell.model, label, shard).set(await cell.redis.xlen(stream))
            first = cast(redis_client.StreamEntries, await cell.redis.xrange(stream, "-", "+", count=1))
            metrics.QUEUE_AGE.labels(cell.model, label, shard).set(_age_s(first, now))


def _age_s(first: redis_client.StreamEntries, now: int) -> float:
    """Seconds the stream's head entry (an XRANGE COUNT 1 reply) has waited; 0.0 when there is none,
    or when it does not decode (the batch loop drops it when it reads it)."""
    if not first:
        return 0.0
    try:
        item = queue.decode_item(first[0][1])
    except queue.Undecodable:
        return 0.0
    return max(0.0, (now - item.enqueued_unix_ms) / 1000) if item.enqueued_unix_ms else 0.0
