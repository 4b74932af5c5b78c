"""The batching loop of one model's queue cell (llmserve/protocol/keys.py: cell 0 unless queue_shards > 1).

    XREADGROUP (3 priority streams) ─▶ FairQueue (held, still pending) ─▶ take(batch)
        ─▶ drop expired / cancelled (final event, ack) ─▶ pick worker (prefix, capacity)
        ─▶ Lua: XADD inbox + XACK/XDEL items ─▶ reserve capacity locally

A cell whose workers are all gone hands what it holds to a sibling cell that has live
workers (batcher/rehome.py).

Everything that touches the local queue runs in this one task (reads,
dispatches, reclaims, housekeeping), so there are no races inside a replica;
races between replicas are settled by the ownership check in the dispatch script.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

import structlog
from redis.exceptions import NoScriptError

from batcher import metrics
from batcher.batch_budget import BatchBudget
from batcher.config import BatcherSettings
from batcher.events import DropReason, final_event, write_final
from batcher.fair_queue import FairQueue, Held
from batcher.reclaimer import ReclaimContext, Reclaimer
from batcher.rehome import move_items
from batcher.scripts import Scripts, Source, dispatch_result
from batcher.workers import Capacity, WorkerPool
from llmserve.protocol import fencing, keys, queue
from llmserve.runtime import redis_client, tracing
from llmserve.runtime.clock import now_ms, now_s
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)

_IDLE_BLOCK_MS = 200       # longest a read blocks; bounds how late a stop is noticed
_TOUCH_CHUNK = 500
_PIPELINED = 8             # batches formed and dispatched per Redis round trip
# Unexpected errors in a row after which the loop gives up and takes the process down, so
# its supervisor restarts it (and the operator sees it) instead of it retrying forever.
MAX_CONSECUTIVE_FAILURES = 5

_Plan = tuple[Capacity, list[Held]]
_Drop = tuple[Held, DropReason, str]



class ModelBatcher:
    """Reads one queue cell's work streams and dispatches its batches to the cell's workers;
    see the module docstring."""

    def __init__(self, redis: redis_client.AnyRedis, scripts: Scripts, settings: BatcherSettings, model: str,
                 consumer: str, shard: int = 0, rehome_to: Callable[[], int | None] = lambda: None) -> None:
        self.redis, self.scripts, self.settings = redis, scripts, settings
        self.model, self.shard, self.consumer = model, shard, consumer
        self.limits = settings.limits_for(model)
        self.streams: dict[int, str] = {p: keys.work_stream(model, p, shard) for p in keys.PRIORITY_ORDER}
        self.queue = FairQueue(count_tokens=settings.fair_share == "tokens")
        self.rehome_to = rehome_to
        self.pool = WorkerPool(settings.heartbeat_ttl_ms, settings.capacity_grace_ms)
        self.reclaimer = Reclaimer(ReclaimContext(
            redis, scripts, settings, model, shard, consumer, self.streams, self.pool, self.limits.max_wait_ms,
            held_count=self.queue.count, holds=self.queue.__contains__, accept=self.accept, rehome_to=rehome_to))
        self._reading = True
        self._workers_at = self._touched_at = self._reclaimed_at = 0.0

    # ── lifecycle ──────────────────────────────────────────────────────────

    async def ensure_groups(self) -> None:
        """Create the consumer group on each work stream (from the start, so nothing queued is skipped)."""
        for stream in self.streams.values():
            await queue.ensure_group(self.redis, stream, keys.WORK_GROUP)

    def stop_reading(self) -> None:
        self._reading = False

    async def run(self) -> None:
        """Batch until `stop_reading()`; then flush what is held (bounded by grace_s)."""
        backoff, failures = 0.05, 0
        while self._reading:
            try:
                await self.step()
                backoff, failures = 0.05, 0
            except NoScriptError:
                await self.scripts.load()  # Redis restarted or flushed its script cache
            except redis_client.ANY_ERRORS as exc:
                if redis_client.is_wrong_type(exc):
                    raise           # not an outage: no retry mends a key of the wrong type
                logger.warning("redis error in batch loop", model=self.model, error=repr(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # noqa: BLE001 - one odd step is retried; a persistent one ends the process
                failures += 1
                if failures >= MAX_CONSECUTIVE_FAILURES:
                    raise
                logger.exception("batch loop step failed; retrying", model=self.model, failures=failures)
                await asyncio.sleep(0.2 * failures)
        await self.flush(time.monotonic() + self.settings.grace_s)

    async def step(self) -> None:
        now = time.monotonic()
        await self._maybe_refresh_workers(now)
        await self._read(self._block_ms(now))
        await self.dispatch_ready()
        await self._housekeeping(time.monotonic())

    async def flush(self, deadline: float) -> None:
        """Dispatch everything held, as capacity allows, until `deadline`; leave the rest reclaimable."""
        while self.queue and time.monotonic() < deadline:
            try:
                await self._maybe_refresh_workers(time.monotonic())
                if not await self.dispatch_ready(force=True):
                    await asyncio.sleep(self.settings.workers_poll_ms / 1000)
            except redis_client.ANY_ERRORS as exc:
                logger.warning("redis error while flushing", model=self.model, error=repr(exc))
                await asyncio.sleep(0.1)
        await self._release_held()

    async def _release_held(self) -> None:
        """Mark what is still held as idle so another replica's XAUTOCLAIM takes it at once."""
        by_stream: defaultdict[str, list[Any]] = defaultdict(list)   # redis-py types ids as a list of any id type
        for held in self.queue:
            by_stream[held.stream].append(held.entry_id)
        for stream, ids in by_stream.items():
            try:
                await self.redis.xclaim(stream, keys.WORK_GROUP, self.consumer, 0, ids,
                                        idle=self.settings.claim_idle_ms, justid=True)
            except redis_client.ANY_ERRORS as exc:
                logger.warning("could not release held items", model=self.model, error=repr(exc))
        if self.queue:
            logger.info("left items for other replicas", model=self.model, count=len(self.queue))

    # ── reading ───────────────────────────────────────────────────────────

    def _block_ms(self, now: float) -> int:
        """How long the next read may block: until the oldest held item's wait is over."""
        oldest = self.queue.oldest_read_at()
        if oldest is None:
            return _IDLE_BLOCK_MS
        if self._full():
            return 0
        left_ms = (oldest + self.limits.max_wait_ms / 1000 - now) * 1000
        if left_ms <= 0:
            return min(self.settings.workers_poll_ms, _IDLE_BLOCK_MS)  # ready, waiting for capacity
        return max(1, min(int(left_ms + 0.999), _IDLE_BLOCK_MS))

    async def _read(self, block_ms: int) -> None:
        """Read what arrived. With nothing held, the read BLOCKs (a new item wakes it at once). With
        items held, the wait (a batching window, a capacity poll) is slept here and the read does not
        block: a server's BLOCK timeout fires only on its clock tick, up to 100 ms late at Redis's
        and Valkey's default hz 10, and that lateness would land on every request's TTFT."""
        rooms = {self.streams[p]: self.settings.read_ahead - self.queue.count(p) for p in keys.PRIORITY_ORDER}
        rooms = {s: r for s, r in rooms.items() if r > 0}
        holding = bool(self.queue)
        if holding or not rooms:
            await asyncio.sleep(block_ms / 1000)
        if not rooms:
            return
        reply = cast(redis_client.StreamReply, await self.redis.xreadgroup(
            keys.WORK_GROUP, self.consumer, {s: ">" for s in rooms}, count=max(rooms.values()),
            block=None if holding else block_ms))
        read_at = time.monotonic()
        for stream, entries in reply or []:
            await self.accept(redis_client.text(stream), entries, read_at)
        metrics.HELD.labels(self.model, str(self.shard)).set(len(self.queue))

    async def accept(self, stream: str, entries: list, read_at: float) -> int:
        """Queue entries read or claimed from `stream`; malformed ones are acked and counted."""
        accepted, malformed = 0, []
        for entry_id, fields in entries:
            entry_id = redis_client.text(entry_id)
            try:
                item = queue.decode_item(fields)
            except queue.Undecodable:
                malformed.append(entry_id)
                continue
            accepted += self.queue.push(Held(stream, entry_id, item, read_at, touched_at=read_at))
        if malformed:
            logger.error("dropping malformed work entries", model=self.model, stream=stream, ids=malformed)
            await self._ack(stream, keys.WORK_GROUP, malformed)
            metrics.DROPS.labels(self.model, DropReason.MALFORMED.value).inc(len(malformed))
        return accepted

    # ── dispatching ───────────────────────────────────────────────────────

    def _full(self) -> bool:
        return len(self.queue) >= self.limits.max_batch or \
            self.queue.prompt_tokens >= self.limits.prefill_token_budget

    def _ready(self, now: float) -> bool:
        oldest = self.queue.oldest_read_at()
        if oldest is None:
            return False
        return self._full() or now - oldest >= self.limits.max_wait_ms / 1000

    async def dispatch_ready(self, force: bool = False) -> int:
        """Dispatch batches while one is due (full or waited long enough); returns items sent."""
        sent = 0
        while self.queue and (force or self._ready(time.monotonic())):
            plans, dropped = self._plan(force)
            if dropped:
                await self.drop(dropped)
            if not plans and not dropped:
                metrics.NO_CAPACITY.labels(self.model).inc()
                return sent  # the worker with most room cannot take the next item yet
            sent += await self._send(await self._without_cancelled(plans))
        return sent

    def _plan(self, force: bool) -> tuple[list[_Plan], list[_Drop]]:
        """Up to _PIPELINED due batches, each for the worker `WorkerPool.choose` picks for its first
        item (cached prefix, else most room), capacity reserved."""
        plans: list[_Plan] = []
        dropped: list[_Drop] = []
        while len(plans) < _PIPELINED and self.queue and (force or self._ready(time.monotonic())):
            stamp = now_ms()
            cap = self.pool.choose(self.queue.peek(), stamp, self.settings.decode_reserve)
            if cap is None:
                break
            accepting = self.pool.accepting(stamp)
            largest = max((c.total_blocks for c in accepting), default=0)
            budget = BatchBudget(self.limits, self.settings.decode_reserve, cap, largest, stamp)
            taken = self.queue.take(budget.admit)
            dropped += budget.drops.values()
            batch = [h for h in taken if h not in budget.drops]
            if not batch:
                if not budget.drops:
                    break
                continue
            self.pool.reserve(cap.worker_id, budget.reserved_blocks, len(batch), now_ms())
            plans.append((cap, batch))
        return plans, dropped

    async def _without_cancelled(self, plans: list[_Plan]) -> list[_Plan]:
        """Drop items whose cancel key exists (one pipeline of EXISTS for all plans: the keys live in
        their requests' hash slots, so no MGET; on a cluster the pipeline goes to each node at once)."""
        cancellable = [h for _, batch in plans for h in batch if h.item.cancel_key]
        if not cancellable:
            return plans
        pipe = self.redis.pipeline(transaction=False)
        for h in cancellable:
            pipe.exists(h.item.cancel_key)
        cancelled = {h for h, found in zip(cancellable, await pipe.execute()) if found}
        if not cancelled:
            return plans
        await self.drop([(h, DropReason.CANCELLED, "") for h in cancelled])
        kept = [(cap, [h for h in batch if h not in cancelled]) for cap, batch in plans]
        return [(cap, batch) for cap, batch in kept if batch]

    async def _send(self, plans: list[_Plan]) -> int:
        """Hand each batch to its worker atomically, all in one pipeline.

        Items another replica took over are forgotten; on a Redis error every
        item goes back to the queue (the ownership check settles the outcome).
        """
        try:
            await fencing.issue(self.redis, [h.item for _, batch in plans for h in batch],
                                self.settings.events_ttl_s)
        except redis_client.ANY_ERRORS:
            for _, batch in plans:
                self.queue.extend(batch)
            raise
        pipe = self.redis.pipeline(transaction=False)
        for cap, batch in plans:
            message = queue_pb2.Batch(batch_id=uuid.uuid4().hex, items=[h.item for h in batch],
                                      created_unix_ms=now_ms())
            self.scripts.add_dispatch(pipe, keys.inbox_stream(self.model, cap.worker_id, self.shard),
                                      keys.inboxes_set(self.model, self.shard), cap.worker_id, keys.INBOX_GROUP,
                                      self.consumer, _sources(batch), message.SerializeToString())
        try:
            replies = await pipe.execute()
        except redis_client.ANY_ERRORS:
            for _, batch in plans:
                self.queue.extend(batch)
            raise
        sent: list[queue_pb2.WorkItem] = []
        for (cap, batch), reply in zip(plans, replies):
            result = dispatch_result(reply, _sources(batch))
            if result.ok:
                self._record(batch)
                _trace(batch, cap.worker_id)
                sent += [h.item for h in batch]
            else:  # some entries are no longer ours: forget those, retry the rest
                lost = set(result.lost)
                metrics.CONFLICTS.labels(self.model).inc(len(lost))
                self.queue.extend(h for h in batch if h.ref not in lost)
        await fencing.raise_fence(self.redis, sent, self.settings.events_ttl_s)
        return len(sent)

    def _record(self, batch: list[Held]) -> None:
        wait = time.monotonic() - min(h.read_at for h in batch)
        metrics.BATCH_SIZE.labels(self.model).observe(len(batch))
        metrics.BATCH_PROMPT_TOKENS.labels(self.model).observe(sum(h.prompt_tokens for h in batch))
        metrics.FILL_WAIT.labels(self.model).observe(max(0.0, wait))
        metrics.DISPATCHED.labels(self.model).inc(len(batch))

    async def drop(self, drops: list[_Drop]) -> None:
        """End items without dispatch: final event first, then ack (if still ours)."""
        await write_final(self.redis, [(h.item, final_event(h.item, reason, detail)) for h, reason, detail in drops],
                          self.settings.events_ttl_s)
        await self._ack_held([h for h, _, _ in drops])
        for held, reason, _ in drops:
            metrics.DROPS.labels(self.model, reason.value).inc()
            logger.info("dropped queued request", model=self.model, request_id=held.item.request_id,
                        tenant=held.item.tenant, reason=reason.value, **tracing.log_fields(held.item))

    async def _ack_held(self, helds: list[Held]) -> None:
        """Ack and delete held entries that are still ours (the script acks all or nothing: retry once
        without the entries another replica owns now)."""
        for _ in range(2):
            result = await self.scripts.ack(self.model, self.shard, self.consumer, _sources(helds))
            helds = [h for h in helds if h.ref not in set(result.lost)]
            if result.ok or not helds:
                break

    async def _ack(self, stream: str, group: str, ids: list[str]) -> None:
        await self.scripts.ack(self.model, self.shard, self.consumer, [Source(stream, group, ids)])

    # ── periodic work ─────────────────────────────────────────────────────

    async def _maybe_refresh_workers(self, now: float) -> None:
        if now - self._workers_at < self.settings.workers_poll_ms / 1000:
            return
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(keys.workers_hash(self.model, self.shard)))
        self.pool.update({redis_client.text(k): hb for k, v in raw.items() if (hb := _heartbeat(v)) is not None})
        self._workers_at = now

    async def _housekeeping(self, now: float) -> None:
        touch_every = self.settings.claim_idle_ms / 3000
        if now - self._touched_at >= touch_every:
            self._touched_at = now
            await self._touch(now - touch_every)
        if now - self._reclaimed_at >= self.settings.reclaim_interval_ms / 1000:
            self._reclaimed_at = now
            await self._drop_expired()
            await self._drop_cancelled()
            await self.reclaimer.sweep()
            await self._rehome_held()

    async def _rehome_held(self) -> None:
        """With no live worker in this cell, move everything held to a sibling cell that has one."""
        if not self.queue or self.pool.accepting(now_ms()):
            return
        target = self.rehome_to()
        if target is None:
            return
        helds = self.queue.remove_if(lambda _h: True)
        try:
            await move_items(self.redis, self.model, target, [h.item for h in helds])
        except redis_client.ANY_ERRORS:
            self.queue.extend(helds)
            raise
        await self._ack_held(helds)
        metrics.RECLAIMS.labels(self.model, "rehomed").inc(len(helds))
        logger.info("moved held items to another queue cell", model=self.model, shard=self.shard,
                    to_shard=target, items=len(helds))

    async def _drop_expired(self) -> None:
        stamp = now_ms()
        expired = self.queue.remove_if(lambda h: queue.is_expired(h.item, stamp))
        if expired:
            await self.drop([(h, DropReason.DEADLINE, "") for h in expired])

    async def _drop_cancelled(self) -> None:
        """End held items whose request was cancelled, whether or not any worker has room now: a
        cancelled backlog must not wait for capacity to leave the queue (and its depth)."""
        held = [h for h in self.queue if h.item.cancel_key]
        if not held:
            return
        pipe = self.redis.pipeline(transaction=False)
        for h in held:
            pipe.exists(h.item.cancel_key)
        cancelled = {h.ref for h, found in zip(held, await pipe.execute()) if found}
        if cancelled:
            gone = self.queue.remove_if(lambda h: h.ref in cancelled)
            await self.drop([(h, DropReason.CANCELLED, "") for h in gone])

    async def _touch(self, older_than: float) -> None:
        """Keep held entries from looking idle, so no replica reclaims what we still hold."""
        stale = [h for h in self.queue if h.touched_at <= older_than]
        by_stream: dict[str, list[Held]] = defaultdict(list)
        for held in stale:
            by_stream[held.stream].append(held)
        now = time.monotonic()
        for stream, helds in by_stream.items():
            for i in range(0, len(helds), _TOUCH_CHUNK):
                chunk = helds[i:i + _TOUCH_CHUNK]
                lost = set(await self.scripts.touch(stream, keys.WORK_GROUP, self.consumer,
                                                    [h.entry_id for h in chunk]))
                for held in chunk:
                    held.touched_at = now
                if lost:
                    gone = self.queue.remove_if(_is_among(stream, lost))
                    metrics.CONFLICTS.labels(self.model).inc(len(gone))


def _trace(batch: list[Held], worker_id: str) -> None:
    """A `batch` span per item, from when this replica read it to its dispatch to `worker_id`."""
    if tracing.enabled():
        wall_offset = now_s() - time.monotonic()
        tracing.record_dispatch("batch", [(h.item, h.read_at + wall_offset) for h in batch], worker_id,
                                {"llmserve.batch.size": len(batch)})


def _sources(batch: list[Held]) -> list[Source]:
    by_stream: dict[str, list[str]] = defaultdict(list)
    for held in batch:
        by_stream[held.stream].append(held.entry_id)
    return [Source(stream, keys.WORK_GROUP, ids) for stream, ids in by_stream.items()]


def _is_among(stream: str, entry_ids: set[str]) -> Callable[[Held], bool]:
    return lambda held: held.stream == stream and held.entry_id in entry_ids


def _heartbeat(raw: bytes) -> queue_pb2.WorkerHeartbeat | None:
    """A worker's heartbeat; an undecodable one counts as no heartbeat (the worker looks silent)."""
    try:
        return queue_pb2.WorkerHeartbeat.FromString(raw)
    except Exception:  # noqa: BLE001 - DecodeError and friends
        return None
