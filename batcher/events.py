"""Final token events the batcher writes for items it will not dispatch.

The event goes to the request's own stream (its own `{r:...}` hash tag), so it
cannot share a script with the work-stream ack. It is written first and the
item acked after: a crash in between re-delivers the item and writes the same
final event (same index) again, which the gateway dedupes by index. The XADD and
the stream's TTL are one script: the stream never exists without its TTL.
"""

from __future__ import annotations

from enum import StrEnum

from llmserve.protocol import queue
from llmserve.runtime import redis_client
from llmserve.runtime.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from llmserve.v1 import inference_pb2, queue_pb2


class DropReason(StrEnum):
    """Why an item leaves the queue without reaching a worker (metric label)."""

    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    POISON = "poison"
    TOO_LARGE = "too_large"
    MALFORMED = "malformed"


_ERRORS = {
    DropReason.DEADLINE: lambda: DeadlineExceeded("deadline expired while queued"),
    DropReason.POISON: lambda: Unavailable("request failed on too many workers"),
    DropReason.TOO_LARGE: lambda: ResourceExhausted("kv_cache", 0, "request needs more KV blocks than any worker has"),
}


def final_event(item: queue_pb2.WorkItem, reason: DropReason, detail: str = "") -> queue_pb2.TokenEvent:
    """The last event of a request that ends in the queue: an error, or CANCELLED."""
    if reason is DropReason.CANCELLED:
        return queue.final_event(item, finish_reason=inference_pb2.FINISH_REASON_CANCELLED)
    error = _ERRORS[reason]()
    if detail:
        error.message = f"{error.message}: {detail}"
    return queue.final_event(item, error)


# KEYS: [1] events stream  ARGV: [1] ttl s  [2] event bytes
_XADD_EXPIRING = """
redis.call('XADD', KEYS[1], '*', '%(event_field)s', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
""" % {"event_field": queue.EVENT_FIELD}


async def write_final(redis: redis_client.AnyRedis, items: list[tuple[queue_pb2.WorkItem, queue_pb2.TokenEvent]],
                      ttl_s: int) -> None:
    """XADD each item's final event to its events stream and refresh the stream's TTL."""
    pipe = redis.pipeline(transaction=False)
    for item, event in items:
        if item.events_key:
            pipe.eval(_XADD_EXPIRING, 1, item.events_key, ttl_s, event.SerializeToString())
    await pipe.execute()
