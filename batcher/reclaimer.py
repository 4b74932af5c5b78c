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
from typing import TYPE_CHECKING

import structlog
from redis.exceptions import ResponseError

from batcher import metrics
from batcher.events import DropReason, final_event, write_final
from batcher.scripts import Source
from batcher.workers import Capacity, blocks_needed
from llmserve import fencing, keys
from llmserve.clock import now_ms
from llmserve.v1 import queue_pb2

if TYPE_CHECKING:
    from batcher.model_batcher import ModelBatcher

logger = structlog.get_logger(__name__)

_CLAIM_COUNT = 100
_INBOX_COUNT = 50


class Reclaimer:
    """Sweeps for one model; runs inside that model's batch loop."""

    def __init__(self, owner: ModelBatcher) -> None:
        self.owner = owner
        # Inbox entries we own and still have to re-dispatch: (inbox, entry id) -> items,
        # deliveries already counted (so a retry after "no capacity" does not count twice).
        self._prepared: dict[tuple[str, str], list[queue_pb2.WorkItem]] = {}

    async def sweep(self) -> None:
        await self.claim_work()
        await self.claim_inboxes()

    # ── (a) work items of silent batchers ─────────────────────────────────

    async def claim_work(self) -> int:
        owner, claimed = self.owner, 0
        read_at = time.monotonic() - owner.limits.max_wait_ms / 1000  # waited long enough already
        for priority, stream in owner.streams.items():
            room, start = owner.settings.read_ahead - owner.queue.count(priority), "0-0"
            while room > 0:
                start, entries, _deleted = await owner.redis.xautoclaim(
                    stream, keys.WORK_GROUP, owner.consumer, owner.settings.claim_idle_ms, start,
                    count=min(room, _CLAIM_COUNT))
                fresh = [(i, f) for i, f in entries if f and (stream, _text(i)) not in owner.queue]
                claimed += await owner.accept(stream, fresh, read_at)
                room -= len(entries)
                if _text(start) == "0-0":
                    break
        if claimed:
            metrics.RECLAIMS.labels(owner.model, "batcher").inc(claimed)
            logger.info("reclaimed work items from a silent batcher", model=owner.model, count=claimed)
        return claimed

    # ── (b) inboxes of dead workers ───────────────────────────────────────

    async def claim_inboxes(self) -> None:
        owner, now = self.owner, now_ms()
        if not owner.pool.accepting(now):
            return  # nobody to hand batches to: leave them where they are
        for raw in await owner.redis.smembers(keys.inboxes_set(owner.model)):
            worker_id = _text(raw)
            if not owner.pool.is_alive(worker_id, now):
                await self._claim_inbox(worker_id)
        for key in list(self._prepared):
            await self._redispatch(key)

    async def _claim_inbox(self, worker_id: str) -> None:
        owner = self.owner
        inbox = keys.inbox_stream(owner.model, worker_id)
        try:
            unread = await owner.redis.xreadgroup(keys.INBOX_GROUP, owner.consumer, {inbox: ">"},
                                                  count=_INBOX_COUNT)
            _, claimed, _ = await owner.redis.xautoclaim(inbox, keys.INBOX_GROUP, owner.consumer,
                                                         owner.settings.inbox_claim_idle_ms, "0-0",
                                                         count=_INBOX_COUNT)
        except ResponseError as exc:  # inbox or its group is gone: nothing to reclaim
            if "NOGROUP" not in str(exc):
                raise
            await owner.redis.srem(keys.inboxes_set(owner.model), worker_id)
            return
        for _, entries in unread or []:
            for entry_id, fields in entries:
                self._prepare(inbox, _text(entry_id), fields, delivered=False)
        for entry_id, fields in claimed:
            if fields:
                self._prepare(inbox, _text(entry_id), fields, delivered=True)
        if not unread and not claimed and (await owner.redis.xpending(inbox, keys.INBOX_GROUP))["pending"] == 0:
            await owner.redis.srem(keys.inboxes_set(owner.model), worker_id)  # fully drained

    def _prepare(self, inbox: str, entry_id: str, fields: dict, delivered: bool) -> None:
        if (inbox, entry_id) in self._prepared:
            return
        try:
            items = list(queue_pb2.Batch.FromString(fields[b"batch"]).items)
        except Exception:  # noqa: BLE001 - an undecodable batch is acked below with no items
            logger.error("malformed inbox entry", inbox=inbox, entry_id=entry_id)
            items = []
        for item in items:
            item.deliveries += int(delivered)
        self._prepared[(inbox, entry_id)] = items
        metrics.RECLAIMS.labels(self.owner.model, "inbox").inc()
        logger.info("reclaimed batch from dead worker", inbox=inbox, entry_id=entry_id, items=len(items),
                    delivered=delivered)

    async def _redispatch(self, key: tuple[str, str]) -> None:
        owner, (inbox, entry_id) = self.owner, key
        items = await self._fail_poison(self._prepared[key])
        self._prepared[key] = items
        source = [Source(inbox, keys.INBOX_GROUP, [entry_id])]
        if not items:  # nothing left to run: just retire the entry
            await owner.scripts.dispatch(keys.inboxes_set(owner.model), keys.inboxes_set(owner.model), "",
                                         keys.INBOX_GROUP, owner.consumer, source, b"")
            del self._prepared[key]
            return
        cap = self._target(items)
        if cap is None:
            metrics.NO_CAPACITY.labels(owner.model).inc()
            return  # retried on the next sweep
        await fencing.issue(owner.redis, items, owner.settings.events_ttl_s)
        batch = queue_pb2.Batch(batch_id=uuid.uuid4().hex, items=items, created_unix_ms=now_ms())
        result = await owner.scripts.dispatch(
            keys.inbox_stream(owner.model, cap.worker_id), keys.inboxes_set(owner.model), cap.worker_id,
            keys.INBOX_GROUP, owner.consumer, source, batch.SerializeToString())
        del self._prepared[key]  # dispatched, or another replica owns it now
        if result.ok:
            await fencing.raise_fence(owner.redis, items, owner.settings.events_ttl_s)
            blocks = sum(blocks_needed(i, cap.block_size, owner.settings.decode_reserve) for i in items)
            owner.pool.reserve(cap.worker_id, blocks, len(items), now_ms())
            metrics.DISPATCHED.labels(owner.model).inc(len(items))
            logger.info("redispatched batch", from_inbox=inbox, to_worker=cap.worker_id, items=len(items))

    async def _fail_poison(self, items: list[queue_pb2.WorkItem]) -> list[queue_pb2.WorkItem]:
        """Fail items that already went to `max_deliveries` workers; return the rest."""
        limit = self.owner.settings.max_deliveries
        poison = [i for i in items if i.deliveries >= limit]
        if poison:
            await write_final(self.owner.redis, [(i, final_event(i, DropReason.POISON, f"{i.deliveries} deliveries"))
                                                 for i in poison], self.owner.settings.events_ttl_s)
            metrics.DROPS.labels(self.owner.model, DropReason.POISON.value).inc(len(poison))
            for item in poison:
                logger.warning("failing poison request", request_id=item.request_id, tenant=item.tenant,
                               deliveries=item.deliveries)
        return [i for i in items if i.deliveries < limit]

    def _target(self, items: list[queue_pb2.WorkItem]) -> Capacity | None:
        """The accepting worker with most room that can admit the whole batch."""
        decode_reserve = self.owner.settings.decode_reserve
        for cap in self.owner.pool.accepting(now_ms()):
            blocks = sum(blocks_needed(i, cap.block_size, decode_reserve) for i in items)
            if cap.free_seqs >= len(items) and cap.free_blocks >= blocks:
                return cap
        return None



def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
