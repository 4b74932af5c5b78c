"""Reclaiming what the dead left behind, with XAUTOCLAIM.

(a) Work items pending on a batcher that stopped touching them (crashed, or
    left them on purpose at shutdown) for `claim_idle_ms` join our local
    queues. XAUTOCLAIM moves ownership, so only one replica gets each entry.
(b) Batches in the inbox of a worker whose heartbeat expired (or vanished) go
    to a live worker, whole, with `deliveries + 1` on every item the dead worker
    had read; the old inbox entry is acked and deleted in the same script.
    Items already delivered `max_deliveries` times fail with UNAVAILABLE.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import cast

import structlog
from redis.exceptions import ResponseError

from batcher import metrics
from batcher.config import BatcherSettings
from batcher.events import DropReason, final_event, write_final
from batcher.rehome import move_items
from batcher.scripts import Scripts, Source
from batcher.workers import Capacity, WorkerPool, blocks_needed
from llmserve.protocol import fencing, keys, queue
from llmserve.runtime import redis_client, tracing
from llmserve.runtime.clock import now_ms, now_s
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)

_CLAIM_COUNT = 100
_INBOX_COUNT = 50


@dataclass(frozen=True)
class ReclaimContext:
    """What the reclaimer needs of its model's batch loop (and nothing else of it)."""

    redis: redis_client.AnyRedis
    scripts: Scripts
    settings: BatcherSettings
    model: str
    shard: int                                        # the model's queue cell (llmserve/protocol/keys.py)
    consumer: str
    streams: Mapping[int, str]                        # priority -> work stream
    pool: WorkerPool
    max_wait_ms: float
    held_count: Callable[[int], int]                  # items held locally, by priority
    holds: Callable[[tuple[str, str]], bool]          # whether (stream, entry id) is held locally
    accept: Callable[[str, list, float], Awaitable[int]]  # queue claimed entries locally
    rehome_to: Callable[[], int | None]               # a sibling cell with live workers (batcher/rehome.py)


class Reclaimer:
    """Sweeps for one model; runs inside that model's batch loop."""

    def __init__(self, ctx: ReclaimContext) -> None:
        self.ctx = ctx
        # Inbox entries we own and still have to re-dispatch: (inbox, entry id) -> items,
        # deliveries already counted (so a retry after "no capacity" does not count twice).
        self._prepared: dict[tuple[str, str], list[queue_pb2.WorkItem]] = {}

    async def sweep(self) -> None:
        await self.claim_work()
        await self.claim_inboxes()

    # ── (a) work items of silent batchers ─────────────────────────────────

    async def claim_work(self) -> int:
        ctx, claimed = self.ctx, 0
        read_at = time.monotonic() - ctx.max_wait_ms / 1000  # waited long enough already
        for priority, stream in ctx.streams.items():
            room, start = ctx.settings.read_ahead - ctx.held_count(priority), "0-0"
            while room > 0:
                start, entries, _deleted = await ctx.redis.xautoclaim(
                    stream, keys.WORK_GROUP, ctx.consumer, ctx.settings.claim_idle_ms, start,
                    count=min(room, _CLAIM_COUNT))
                fresh = [(i, f) for i, f in entries if f and not ctx.holds((stream, redis_client.text(i)))]
                claimed += await ctx.accept(stream, fresh, read_at)
                room -= len(entries)
                if redis_client.text(start) == "0-0":
                    break
        if claimed:
            metrics.RECLAIMS.labels(ctx.model, "batcher").inc(claimed)
            logger.info("reclaimed work items from a silent batcher", model=ctx.model, count=claimed)
        return claimed

    # ── (b) inboxes of dead workers ───────────────────────────────────────

    async def claim_inboxes(self) -> None:
        """Re-dispatch dead workers' batches to this cell's live workers; when it has none, move
        them to a sibling cell that has (batcher/rehome.py); when no cell has, leave them."""
        ctx, now = self.ctx, now_ms()
        accepting = bool(ctx.pool.accepting(now))
        rehome_to = None if accepting else ctx.rehome_to()
        if not accepting and rehome_to is None:
            return  # nobody to hand batches to: leave them where they are
        for raw in await ctx.redis.smembers(keys.inboxes_set(ctx.model, ctx.shard)):
            worker_id = redis_client.text(raw)
            if not ctx.pool.is_alive(worker_id, now):
                await self._claim_inbox(worker_id)
        for key in list(self._prepared):
            if rehome_to is None:
                await self._redispatch(key)
            else:
                await self._rehome(key, rehome_to)

    async def _claim_inbox(self, worker_id: str) -> None:
        ctx = self.ctx
        inbox = keys.inbox_stream(ctx.model, worker_id, ctx.shard)
        try:
            unread = cast(redis_client.StreamReply, await ctx.redis.xreadgroup(
                keys.INBOX_GROUP, ctx.consumer, {inbox: ">"}, count=_INBOX_COUNT))
            _, claimed, _ = cast(redis_client.AutoclaimReply, await ctx.redis.xautoclaim(
                inbox, keys.INBOX_GROUP, ctx.consumer, ctx.settings.inbox_claim_idle_ms, "0-0",
                count=_INBOX_COUNT))
        except ResponseError as exc:  # inbox or its group is gone: nothing to reclaim
            if "NOGROUP" not in str(exc):
                raise
            await ctx.redis.srem(keys.inboxes_set(ctx.model, ctx.shard), worker_id)
            return
        for _, entries in unread or []:
            for entry_id, fields in entries:
                self._prepare(inbox, redis_client.text(entry_id), fields, delivered=False)
        for entry_id, fields in claimed:
            if fields:
                self._prepare(inbox, redis_client.text(entry_id), fields, delivered=True)
        if not unread and not claimed and (await ctx.redis.xpending(inbox, keys.INBOX_GROUP))["pending"] == 0:
            await ctx.redis.srem(keys.inboxes_set(ctx.model, ctx.shard), worker_id)  # fully drained

    def _prepare(self, inbox: str, entry_id: str, fields: dict, delivered: bool) -> None:
        if (inbox, entry_id) in self._prepared:
            return
        try:
            items = list(queue.decode_batch(fields).items)
        except queue.Undecodable as exc:  # acked below with no items
            logger.error("malformed inbox entry", inbox=inbox, entry_id=entry_id, error=str(exc))
            items = []
        for item in items:
            item.deliveries += int(delivered)
        self._prepared[(inbox, entry_id)] = items
        metrics.RECLAIMS.labels(self.ctx.model, "inbox").inc()
        logger.info("reclaimed batch from dead worker", inbox=inbox, entry_id=entry_id, items=len(items),
                    delivered=delivered)

    async def _redispatch(self, key: tuple[str, str]) -> None:
        ctx, (inbox, entry_id) = self.ctx, key
        items = await self._fail_poison(self._prepared[key])
        self._prepared[key] = items
        source = [Source(inbox, keys.INBOX_GROUP, [entry_id])]
        if not items:  # nothing left to run: just retire the entry
            await ctx.scripts.ack(ctx.model, ctx.shard, ctx.consumer, source)
            del self._prepared[key]
            return
        cap = self._target(items)
        if cap is None:
            metrics.NO_CAPACITY.labels(ctx.model).inc()
            return  # retried on the next sweep
        await fencing.issue(ctx.redis, items, ctx.settings.events_ttl_s)
        batch = queue_pb2.Batch(batch_id=uuid.uuid4().hex, items=items, created_unix_ms=now_ms())
        result = await ctx.scripts.dispatch(
            keys.inbox_stream(ctx.model, cap.worker_id, ctx.shard), keys.inboxes_set(ctx.model, ctx.shard), cap.worker_id,
            keys.INBOX_GROUP, ctx.consumer, source, batch.SerializeToString())
        del self._prepared[key]  # dispatched, or another replica owns it now
        if result.ok:
            await fencing.raise_fence(ctx.redis, items, ctx.settings.events_ttl_s)
            blocks = sum(blocks_needed(i, cap.block_size, ctx.settings.decode_reserve) for i in items)
            ctx.pool.reserve(cap.worker_id, blocks, len(items), now_ms())
            metrics.DISPATCHED.labels(ctx.model).inc(len(items))
            tracing.record_dispatch("reclaim", [(i, now_s()) for i in items], cap.worker_id,
                                    {"llmserve.reclaimed_from": inbox})
            logger.info("redispatched batch", from_inbox=inbox, to_worker=cap.worker_id, items=len(items))

    async def _rehome(self, key: tuple[str, str], target_shard: int) -> None:
        ctx, (inbox, entry_id) = self.ctx, key
        items = await self._fail_poison(self._prepared[key])
        await move_items(ctx.redis, ctx.model, target_shard, items)
        await ctx.scripts.ack(ctx.model, ctx.shard, ctx.consumer, [Source(inbox, keys.INBOX_GROUP, [entry_id])])
        del self._prepared[key]
        metrics.RECLAIMS.labels(ctx.model, "rehomed").inc(len(items))
        logger.info("moved a dead worker's batch to another queue cell", from_inbox=inbox, to_shard=target_shard,
                    items=len(items))

    async def _fail_poison(self, items: list[queue_pb2.WorkItem]) -> list[queue_pb2.WorkItem]:
        """Fail items that already went to `max_deliveries` workers; return the rest."""
        limit = self.ctx.settings.max_deliveries
        poison = [i for i in items if i.deliveries >= limit]
        if poison:
            await write_final(self.ctx.redis, [(i, final_event(i, DropReason.POISON, f"{i.deliveries} deliveries"))
                                                 for i in poison], self.ctx.settings.events_ttl_s)
            metrics.DROPS.labels(self.ctx.model, DropReason.POISON.value).inc(len(poison))
            for item in poison:
                logger.warning("failing poison request", request_id=item.request_id, tenant=item.tenant,
                               deliveries=item.deliveries, **tracing.log_fields(item))
        return [i for i in items if i.deliveries < limit]

    def _target(self, items: list[queue_pb2.WorkItem]) -> Capacity | None:
        """The accepting worker with most room that can admit the whole batch."""
        decode_reserve = self.ctx.settings.decode_reserve
        for cap in self.ctx.pool.accepting(now_ms()):
            blocks = sum(blocks_needed(i, cap.block_size, decode_reserve) for i in items)
            if cap.free_seqs >= len(items) and cap.free_blocks >= blocks:
                return cap
        return None
