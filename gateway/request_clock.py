"""The clock of one streaming request: deadline, max queue wait, cancel grace,
lease renewal, and the timings that end up in `Usage` and the metrics."""

from __future__ import annotations

import time

from gateway import metrics
from gateway.choices import ChoicesBuilder
from gateway.config import GatewaySettings
from gateway.quota import Quota
from gateway.request_state import Call, Meta
from llmserve.protocol import keys
from llmserve.runtime import redis_client
from llmserve.runtime.clock import now_ms_precise
from llmserve.runtime.errors import DeadlineExceeded, Unavailable
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

_MAX_BLOCK_MS = 500


class QueueWaitExceeded(Unavailable):
    """No worker took the request within max_queue_wait_s (recorded, so a resume fails the same way)."""


class Watch:
    def __init__(self, settings: GatewaySettings, redis: redis_client.AnyRedis, quota: Quota, call: Call,
                 meta: Meta) -> None:
        self.settings = settings
        self.redis = redis
        self.quota = quota
        self.call = call
        self.meta = meta
        self.first_event: queue_pb2.TokenEvent | None = None
        self.first_token_ms: float | None = None
        self.last_chunk_s: float | None = None
        self.cancel_seen_s: float | None = None
        self.dispatched = False
        self.next_renew_s = time.monotonic() + settings.lease_ttl_s / 3

    # -- the loop's timing ---------------------------------------------------------------------------------
    def block_ms(self) -> int:
        if self.call.deadline is None:
            return _MAX_BLOCK_MS
        left_ms = int((self.call.deadline - time.monotonic()) * 1000)
        return max(1, min(_MAX_BLOCK_MS, left_ms))

    def saw_event(self, event: queue_pb2.TokenEvent) -> None:
        if self.first_event is None:
            self.first_event = event
            if event.admitted_unix_ms and self.meta.enqueued_ms:
                metrics.QUEUE.labels(self.meta.model).observe(
                    max(0.0, event.admitted_unix_ms - self.meta.enqueued_ms) / 1000)

    async def tick(self, got_events: bool) -> bool:
        """Checks between reads; raises on deadline/queue wait; False once a cancel's grace ran out."""
        now = time.monotonic()
        if self.call.deadline is not None and now >= self.call.deadline:
            raise DeadlineExceeded("deadline exceeded while generating")
        if self.first_event is None and not self.dispatched and \
                now_ms_precise() - self.meta.enqueued_ms > self.settings.max_queue_wait_s * 1000:
            await self._check_still_queued()
        if now >= self.next_renew_s:
            self.next_renew_s = now + self.settings.lease_ttl_s / 3
            await self.quota.renew(self.call.tenant.id, self.call.request_id)
        if got_events:
            return True
        return await self._cancel_pending(now)

    async def _check_still_queued(self) -> None:
        """Past the max queue wait: fail if the item still sits in the work stream (the batcher
        XDELs what it dispatched; a dispatched request may still be in a long prefill)."""
        if self.meta.work_key and self.meta.entry_id:
            queued = await self.redis.xrange(self.meta.work_key, self.meta.entry_id, self.meta.entry_id)
            if not queued:
                self.dispatched = True
                return
        raise QueueWaitExceeded(f"overloaded: no worker took the request within {self.settings.max_queue_wait_s} s")

    async def _cancel_pending(self, now: float) -> bool:
        if self.cancel_seen_s is None:
            if await self.redis.exists(keys.cancel_key(self.call.tenant.id, self.call.request_id)):
                self.cancel_seen_s = now
            return True
        return now - self.cancel_seen_s < self.settings.cancel_grace_s

    # -- timings -------------------------------------------------------------------------------------------
    def observe_chunk(self, chunk: pb.GenerateResponse, model: str, builder: ChoicesBuilder) -> None:
        now_s = time.monotonic()
        if chunk.token_ids and self.first_token_ms is None:
            self.first_token_ms = now_ms_precise()
            metrics.TTFT.labels(model).observe(max(0.0, self.first_token_ms - self.meta.arrival_ms) / 1000)
        elif chunk.token_ids and self.last_chunk_s is not None:
            metrics.INTER_TOKEN.labels(model).observe((now_s - self.last_chunk_s) / len(chunk.token_ids))
        if chunk.token_ids:
            self.last_chunk_s = now_s
        if builder.done:
            metrics.E2E.labels(model).observe(max(0.0, now_ms_precise() - self.meta.arrival_ms) / 1000)

    def usage(self, builder: ChoicesBuilder, meta: Meta) -> pb.Usage:
        end = now_ms_precise()
        first = self.first_event
        admitted = first.admitted_unix_ms if first is not None and first.admitted_unix_ms else 0
        ttft = (self.first_token_ms or end) - meta.arrival_ms
        return pb.Usage(
            prompt_tokens=(first.prompt_tokens if first is not None and first.prompt_tokens else meta.prompt_tokens),
            completion_tokens=builder.next_index,
            cached_prompt_tokens=first.cached_prompt_tokens if first is not None else 0,
            queue_ms=max(0.0, admitted - meta.enqueued_ms) if admitted else 0.0,
            ttft_ms=max(0.0, ttft), total_ms=max(0.0, end - meta.arrival_ms))

    def cancelled_chunk(self, builder: ChoicesBuilder, meta: Meta) -> pb.GenerateResponse:
        chunk = builder.cancelled()
        chunk.usage.CopyFrom(self.usage(builder, meta))
        return chunk
