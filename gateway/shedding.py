"""Load shedding: refuse at once what the queue cannot take, or cannot serve in time.

Queue full (UNAVAILABLE "overloaded"), instead of queueing forever. HIGH priority keeps a
reserved share:

    depth (all priorities) <  (1 - high_reserved_share) * queue_max_depth   anyone
    depth (all priorities) <  queue_max_depth                               HIGH only

Depth is XLEN of the work streams of every queue cell (the batcher XDELs what it
dispatched), read in one pipelined round trip.

Unmeetable TTFT target (RESOURCE_EXHAUSTED "slo_unmeetable" with `retry-after-ms`), only for
a tenant with `shed_unmeetable: true`: once the prompt is tokenized, the TTFT predicted from
the measured queue and prefill rates (gateway/slo_estimate.py) exceeds the request's target.
The retry hint is the excess, the time the queue needs to shrink by that much.
"""

from __future__ import annotations

from gateway import metrics, slo
from gateway.slo_estimate import ServiceEstimate
from llmserve.protocol import keys
from llmserve.runtime import redis_client
from llmserve.runtime.errors import ResourceExhausted, Unavailable
from llmserve.v1 import inference_pb2 as pb

_MIN_RETRY_MS, _MAX_RETRY_MS = 100, 60_000


class Shedder:
    def __init__(self, redis: redis_client.AnyRedis, max_depth: int, high_reserved_share: float,
                 queue_shards: int = 1) -> None:
        self.redis = redis
        self.queue_shards = queue_shards
        self.max_depth = max_depth
        self.shared_depth = max(1, int(max_depth * (1.0 - high_reserved_share)))
        self.estimate = ServiceEstimate()

    def bound(self, priority: int) -> int:
        return self.max_depth if priority == pb.PRIORITY_HIGH else self.shared_depth

    async def depths(self, model: str) -> dict[int, int]:
        """Queued requests of `model` per priority, over every queue cell."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for shard in range(self.queue_shards):
                for priority in keys.PRIORITY_ORDER:
                    pipe.xlen(keys.work_stream(model, priority, shard))
            lengths = [int(n) for n in await pipe.execute()]
        order = keys.PRIORITY_ORDER
        return {p: sum(lengths[i::len(order)]) for i, p in enumerate(order)}

    async def depth(self, model: str) -> int:
        return sum((await self.depths(model)).values())

    async def check(self, model: str, priority: int, tenant: str) -> int:
        """UNAVAILABLE when the queue is full for `priority`; else the requests queued ahead of it
        (at its priority or above)."""
        depths = await self.depths(model)
        depth = sum(depths.values())
        if depth >= self.bound(priority):
            metrics.REJECTIONS.labels(tenant, "overloaded").inc()
            raise Unavailable(f"overloaded: {depth} requests queued for {model}; retry later")
        return sum(n for p, n in depths.items() if p >= priority)

    def check_slo(self, model: str, priority: int, tenant: str, ttft_target_ms: int, waited_ms: float,
                  ahead: int, prompt_tokens: int) -> None:
        """RESOURCE_EXHAUSTED when the predicted TTFT exceeds the target (the caller checks that the
        tenant asked for early refusal)."""
        if not ttft_target_ms:
            return
        predicted = self.estimate.ttft_ms(model, priority, waited_ms, ahead, prompt_tokens, ttft_target_ms)
        if predicted is None or predicted <= ttft_target_ms:
            return
        metrics.REJECTIONS.labels(tenant, "slo_unmeetable").inc()
        slo.count_refused(tenant, priority)
        retry_ms = min(_MAX_RETRY_MS, max(_MIN_RETRY_MS, int(predicted - ttft_target_ms)))
        raise ResourceExhausted("slo_unmeetable", retry_ms,
                                f"slo_ttft_ms: {ttft_target_ms} ms cannot be met now (predicted "
                                f"{predicted:.0f} ms with {ahead} requests queued ahead); retry after {retry_ms} ms")
