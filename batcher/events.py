"""Final token events the batcher writes for items it will not dispatch.

The event goes to the request's own stream (its own `{r:...}` hash tag), so it
cannot share a script with the work-stream ack. It is written first and the
item acked after: a crash in between re-delivers the item and writes the same
final event (same index) again, which the gateway dedupes by index.
"""

from __future__ import annotations

from enum import Enum

import redis.asyncio as aioredis

from llmserve.clock import now_ms
from llmserve.v1 import inference_pb2, queue_pb2


class DropReason(str, Enum):
    """Why an item leaves the queue without reaching a worker (metric label)."""

    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    POISON = "poison"
    TOO_LARGE = "too_large"
    MALFORMED = "malformed"


_ERRORS = {
    DropReason.DEADLINE: ("DEADLINE_EXCEEDED", "deadline expired while queued"),
    DropReason.POISON: ("UNAVAILABLE", "request failed on too many workers"),
    DropReason.TOO_LARGE: ("RESOURCE_EXHAUSTED", "request needs more KV blocks than any worker has"),
}


def final_event(item: queue_pb2.WorkItem, reason: DropReason, detail: str = "") -> queue_pb2.TokenEvent:
    """The last event of a request that ends in the queue: an error, or CANCELLED."""
    event = queue_pb2.TokenEvent(
        request_id=item.request_id, index=len(item.generated_token_ids), final=True,
        prompt_tokens=len(item.prompt_token_ids))
    if reason is DropReason.CANCELLED:
        event.finish_reason = inference_pb2.FINISH_REASON_CANCELLED
    else:
        code, message = _ERRORS[reason]
        event.error.code = code
        event.error.message = f"{message}: {detail}" if detail else message
    return event


def is_expired(item: queue_pb2.WorkItem, now_unix_ms: int | None = None) -> bool:
    now_unix_ms = now_ms() if now_unix_ms is None else now_unix_ms
    return 0 < item.deadline_unix_ms <= now_unix_ms


async def write_final(redis: aioredis.Redis, items: list[tuple[queue_pb2.WorkItem, queue_pb2.TokenEvent]],
                      ttl_s: int) -> None:
    """XADD each item's final event to its events stream and refresh the stream's TTL."""
    pipe = redis.pipeline(transaction=False)
    for item, event in items:
        if item.events_key:
            pipe.xadd(item.events_key, {"event": event.SerializeToString()})
            pipe.expire(item.events_key, ttl_s)
    await pipe.execute()
