"""Handoff on drain: requeue unfinished work with the tokens produced so far, atomically.

One MULTI: XADD every item back onto its work stream, then XACK + XDEL the inbox entries
they came in. Work streams and the inbox share the queue cell's hash tag, so this also runs
on Redis Cluster (the items go back to the worker's own cell). Whoever picks an item up
continues at index len(generated_token_ids).
"""

from __future__ import annotations

from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import queue_pb2


async def hand_back(redis: redis_client.AnyRedis, model: str, worker_id: str,
                    items: list[queue_pb2.WorkItem], entries: list[str], shard: int = 0) -> None:
    if not items and not entries:
        return
    inbox = keys.inbox_stream(model, worker_id, shard)
    pipe = redis.pipeline(transaction=True)
    for item in items:
        pipe.xadd(keys.work_stream(model, item.priority, shard), queue.item_entry(item))
    if entries:
        queue.ack_and_delete(pipe, inbox, keys.INBOX_GROUP, entries)
    await pipe.execute()
