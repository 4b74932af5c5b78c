"""Heartbeat: the worker's capacity in keys.workers_hash(model), every few hundred ms.

The batcher treats a worker as alive while `sent_unix_ms` is recent and `draining` is false.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog

from gpu_worker.worker_loop import REDIS_ERRORS, Snapshot
from llmserve import keys
from llmserve.clock import now_ms
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)


class Heartbeat:
    """Publishes WorkerHeartbeat until stopped; `remove()` deletes it on clean exit.

    Args:
        snapshot: returns the engine's state now; draining: returns whether the worker drains.
    """

    def __init__(self, redis: aioredis.Redis, model: str, worker_id: str, admin_address: str,
                 interval_s: float, block_size: int, max_running: int,
                 snapshot: Callable[[], Snapshot], draining: Callable[[], bool], shard: int = 0) -> None:
        self.redis = redis
        self.key = keys.workers_hash(model, shard)
        self.model = model
        self.worker_id = worker_id
        self.admin_address = admin_address
        self.interval_s = interval_s
        self.block_size = block_size
        self.max_running = max_running
        self.snapshot = snapshot
        self.draining = draining

    def message(self) -> queue_pb2.WorkerHeartbeat:
        s = self.snapshot()
        return queue_pb2.WorkerHeartbeat(
            worker_id=self.worker_id, model=self.model, free_blocks=s.free_blocks, total_blocks=s.total_blocks,
            block_size=self.block_size, running=s.running, waiting=s.waiting, max_running=self.max_running,
            draining=self.draining(), sent_unix_ms=now_ms(), cached_prefix_hashes=list(s.cached_prefix_hashes),
            admin_address=self.admin_address,
        )

    async def beat(self) -> None:
        await self.redis.hset(self.key, self.worker_id, self.message().SerializeToString())

    async def run(self) -> None:
        while True:
            try:
                await self.beat()
            except REDIS_ERRORS as exc:
                logger.warning("heartbeat failed", error=repr(exc))
            await asyncio.sleep(self.interval_s)

    async def remove(self) -> None:
        await self.redis.hdel(self.key, self.worker_id)
