"""Heartbeat: the worker's capacity in keys.workers_hash(model), every few hundred ms.

The batcher treats a worker as alive while `sent_unix_ms` is recent and `draining` is false.
A write Redis cannot take now (down, OOM under `noeviction`, READONLY in a failover, loading)
is retried with jittered backoff; after `give_up_s` without one written the task raises, so
the worker fails (health NOT_SERVING, exit 1) instead of serving on unseen by the batcher.
Any other error (WRONGTYPE: the workers hash is not a hash) is no outage and ends the task at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
import tenacity

from gpu_worker.engine.engine import EngineStats
from llmserve.protocol import keys
from llmserve.runtime import redis_client
from llmserve.runtime.clock import now_ms
from llmserve.runtime.redis_client import UNAVAILABLE_ERRORS
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)


class Heartbeat:
    """Publishes WorkerHeartbeat until stopped; `remove()` deletes it on clean exit.

    Args:
        snapshot: returns the engine's state now; draining: returns whether the worker drains.
        architecture, weight_format: what the loaded model is (ModelConfig.architecture, LlamaModel.weight_format),
            for ListModels.
        give_up_s: how long writes may fail in a row before `run()` raises.
    """

    def __init__(self, redis: redis_client.AnyRedis, model: str, worker_id: str, admin_address: str,
                 interval_s: float, block_size: int, max_running: int,
                 snapshot: Callable[[], EngineStats], draining: Callable[[], bool], shard: int = 0,
                 give_up_s: float = 30.0, architecture: str = "", weight_format: str = "") -> None:
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
        self.give_up_s = give_up_s
        self.architecture = architecture
        self.weight_format = weight_format

    def message(self) -> queue_pb2.WorkerHeartbeat:
        s = self.snapshot()
        return queue_pb2.WorkerHeartbeat(
            worker_id=self.worker_id, model=self.model, free_blocks=s.free_blocks, total_blocks=s.total_blocks,
            block_size=self.block_size, running=s.running, waiting=s.waiting, max_running=self.max_running,
            draining=self.draining(), sent_unix_ms=now_ms(), cached_prefix_hashes=list(s.cached_prefix_hashes),
            admin_address=self.admin_address, preemptible_seqs=s.preemptible_seqs,
            preemptible_blocks=s.preemptible_blocks, architecture=self.architecture,
            weight_format=self.weight_format,
        )

    async def beat(self) -> None:
        await self.redis.hset(self.key, self.worker_id, self.message().SerializeToString())

    async def run(self) -> None:
        """Beat until cancelled; raises the last Redis error once none was written for give_up_s."""
        while True:
            await self._beat_until_written()
            await asyncio.sleep(self.interval_s)

    async def _beat_until_written(self) -> None:
        retrying = tenacity.AsyncRetrying(
            sleep=asyncio.sleep, reraise=True, stop=tenacity.stop_after_delay(self.give_up_s),
            wait=tenacity.wait_random_exponential(multiplier=self.interval_s / 8, max=self.interval_s),
            retry=tenacity.retry_if_exception_type(UNAVAILABLE_ERRORS),
            before_sleep=lambda state: logger.warning("heartbeat not written; retrying", attempt=state.attempt_number,
                                                      error=repr(state.outcome and state.outcome.exception())))
        async for attempt in retrying:
            with attempt:
                await self.beat()

    async def remove(self) -> None:
        await self.redis.hdel(self.key, self.worker_id)
