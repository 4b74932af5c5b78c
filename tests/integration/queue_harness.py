"""The other side of the batcher's contract, for tests and bench/batcher.py.

Plays the gateway (enqueue WorkItems) and the worker (heartbeats, reading and
acking inbox batches, final events) through the queue protocol of `llmserve.protocol.queue`,
with a plain synchronous Redis client. Calls never block.
"""

from __future__ import annotations

import redis
from redis.exceptions import ResponseError

from llmserve.protocol import keys, queue
from llmserve.runtime.clock import now_ms
from llmserve.v1 import inference_pb2, queue_pb2

MODEL = "m"



def make_item(request_id: str, tenant: str = "t", *, model: str = MODEL, prompt_len: int = 4,
              max_new_tokens: int = 16, priority: int = inference_pb2.PRIORITY_NORMAL,
              deadline_unix_ms: int = 0) -> queue_pb2.WorkItem:
    stamp = now_ms()
    return queue_pb2.WorkItem(
        request_id=request_id, tenant=tenant, model=model, prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling=queue_pb2.ResolvedSampling(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                            stop_token_ids=[2]),
        priority=priority, deadline_unix_ms=deadline_unix_ms, arrival_unix_ms=stamp, enqueued_unix_ms=stamp,
        events_key=keys.events_stream(tenant, request_id), cancel_key=keys.cancel_key(tenant, request_id))


def enqueue(client: redis.Redis, *items: queue_pb2.WorkItem, shard: int = 0) -> None:
    """XADD items to their work streams (of queue cell `shard`), all in one MULTI (a batcher sees
    all or none)."""
    pipe = client.pipeline(transaction=True)
    for item in items:
        pipe.xadd(keys.work_stream(item.model, item.priority or inference_pb2.PRIORITY_NORMAL, shard),
                  queue.item_entry(item))
    pipe.execute()


def heartbeat(client: redis.Redis, worker_id: str, *, model: str = MODEL, free_blocks: int = 100_000,
              total_blocks: int | None = None, block_size: int = 16, running: int = 0, max_running: int = 4096,
              draining: bool = False, sent_unix_ms: int | None = None, cached_prefix_hashes: list[int] = (),
              shard: int = 0) -> None:
    hb = queue_pb2.WorkerHeartbeat(
        worker_id=worker_id, model=model, free_blocks=free_blocks,
        total_blocks=free_blocks if total_blocks is None else total_blocks, block_size=block_size,
        running=running, max_running=max_running, draining=draining,
        sent_unix_ms=now_ms() if sent_unix_ms is None else sent_unix_ms, cached_prefix_hashes=cached_prefix_hashes)
    client.hset(keys.workers_hash(model, shard), worker_id, hb.SerializeToString())


def ensure_inbox(client: redis.Redis, worker_id: str, model: str = MODEL, shard: int = 0) -> None:
    try:
        client.xgroup_create(keys.inbox_stream(model, worker_id, shard), keys.INBOX_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def read_inbox(client: redis.Redis, worker_id: str, model: str = MODEL,
               count: int = 1000, shard: int = 0) -> list[tuple[str, queue_pb2.Batch]]:
    """New batches in the worker's inbox, read as the worker (they become pending on it)."""
    ensure_inbox(client, worker_id, model, shard)
    reply = client.xreadgroup(keys.INBOX_GROUP, worker_id, {keys.inbox_stream(model, worker_id, shard): ">"},
                              count=count)
    return [(entry_id.decode(), queue.decode_batch(fields))
            for _, entries in reply or [] for entry_id, fields in entries]


def peek_inbox(client: redis.Redis, worker_id: str, model: str = MODEL, shard: int = 0) -> list[queue_pb2.Batch]:
    """Every batch entry still in the inbox stream, without reading it as a consumer."""
    entries = client.xrange(keys.inbox_stream(model, worker_id, shard))
    return [queue.decode_batch(fields) for _, fields in entries]


def finish(client: redis.Redis, worker_id: str, entry_id: str, batch: queue_pb2.Batch,
           model: str = MODEL) -> None:
    """What a worker does when a batch is done: a final event per item, then XACK."""
    pipe = client.pipeline(transaction=False)
    for item in batch.items:
        event = queue_pb2.TokenEvent(request_id=item.request_id, index=0, token_ids=[7], final=True,
                                     finish_reason=inference_pb2.FINISH_REASON_STOP, worker_id=worker_id)
        pipe.xadd(item.events_key, queue.event_entry(event))
    pipe.xack(keys.inbox_stream(model, worker_id), keys.INBOX_GROUP, entry_id)
    pipe.execute()


def events(client: redis.Redis, item: queue_pb2.WorkItem) -> list[queue_pb2.TokenEvent]:
    return [queue.decode_event(fields) for _, fields in client.xrange(item.events_key)]


def pending_work(client: redis.Redis, model: str = MODEL, shard: int = 0) -> int:
    """Items still on the work streams of a queue cell (undelivered or pending on a batcher)."""
    return sum(client.xlen(keys.work_stream(model, p, shard)) for p in keys.PRIORITY_ORDER)
