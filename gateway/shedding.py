"""Load shedding: refuse at once (UNAVAILABLE "overloaded") when a model's queue is
full, instead of queueing forever. HIGH priority keeps a reserved share:

    depth (all priorities) <  (1 - high_reserved_share) * queue_max_depth   anyone
    depth (all priorities) <  queue_max_depth                               HIGH only

Depth is XLEN of the work streams of every queue cell (the batcher XDELs what it
dispatched), read in one pipelined round trip.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway import metrics
from llmserve import keys
from llmserve.errors import Unavailable
from llmserve.v1 import inference_pb2 as pb


class Shedder:
    def __init__(self, redis: aioredis.Redis, max_depth: int, high_reserved_share: float,
                 queue_shards: int = 1) -> None:
        self.redis = redis
        self.queue_shards = queue_shards
        self.max_depth = max_depth
        self.shared_depth = max(1, int(max_depth * (1.0 - high_reserved_share)))

    def bound(self, priority: int) -> int:
        return self.max_depth if priority == pb.PRIORITY_HIGH else self.shared_depth

    async def depth(self, model: str) -> int:
        async with self.redis.pipeline(transaction=False) as pipe:
            for shard in range(self.queue_shards):
                for priority in keys.PRIORITY_ORDER:
                    pipe.xlen(keys.work_stream(model, priority, shard))
            return sum(int(n) for n in await pipe.execute())

    async def check(self, model: str, priority: int, tenant: str) -> None:
        depth = await self.depth(model)
        if depth >= self.bound(priority):
            metrics.REJECTIONS.labels(tenant, "overloaded").inc()
            raise Unavailable(f"overloaded: {depth} requests queued for {model}; retry later")
