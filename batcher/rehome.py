"""Rehoming: a queue cell with no live worker hands its work to a sibling cell that has one.

A model's queue cells (llmserve/protocol/keys.py) are independent queues. Gateways only send new
requests to cells with live workers, but a cell can still lose its last worker while it
holds work: kill -9, a crash loop, a scale-down whose drained workers handed their work
back to their own cell. Its batch loop then moves what it holds, and its reclaimer what it
took from dead inboxes, onto the work streams of a cell whose workers accept batches:

    XADD each item to the target cell's work stream  ─▶  XACK + XDEL the sources here

The two cells live in different hash slots, so the move is two steps, not one script. A
crash in between leaves the item in both cells; both copies may run, and the request's
fencing epochs (llmserve/protocol/fencing.py) let only the newest dispatch write its events, as
after any reclaim.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import queue_pb2


async def move_items(redis: redis_client.AnyRedis, model: str, target_shard: int,
                     items: Sequence[queue_pb2.WorkItem]) -> None:
    """Append `items` to the target cell's work streams (one round trip)."""
    pipe = redis.pipeline(transaction=False)
    for item in items:
        pipe.xadd(keys.work_stream(model, item.priority, target_shard), queue.item_entry(item))
    await pipe.execute()
