"""Fencing tokens: a worker declared dead must not write into a request it lost.

A worker can be declared dead while it is only paused (GC pause, VM freeze, SIGSTOP past
the heartbeat TTL). Its batches are reclaimed and run elsewhere; when it wakes up it must
not write token events for those requests. So every dispatch of a request carries an
epoch, and every event write checks it atomically:

    batcher: epoch = HINCRBY epoch-key issued 1     (before the dispatch script)
             dispatch ok ─▶ raise_fence(epoch)        (older epochs refused from now on)
    worker:  fenced_xadd(events, epoch)               (refused when a newer epoch exists)

"Highest epoch wins": a write with epoch e is accepted while no newer dispatch has raised
the fence or written, and raises the fence to e itself. Two batcher replicas that both
issued an epoch for the same item cannot fence each other out: only the one whose
dispatch succeeded raises the fence. The epoch key, the events stream and the request's
meta share the request's `{r:...}` hash tag, so the scripts run on Redis Cluster too.
The event write also renews the meta's TTL: a running request keeps its meta alive.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import queue_pb2

ISSUED, FENCE = "issued", "fence"

# KEYS: [1] epoch hash  ARGV: [1] ttl s. Returns the new epoch. One script, so the epoch key
# never exists without its TTL (a reader between the two commands would see a key that lives forever).
_ISSUE = """
local epoch = redis.call('HINCRBY', KEYS[1], 'issued', 1)
redis.call('EXPIRE', KEYS[1], ARGV[1])
return epoch
"""

# KEYS: [1] epoch hash  ARGV: [1] epoch  [2] ttl s
_RAISE = """
local fence = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) > fence then redis.call('HSET', KEYS[1], 'fence', ARGV[1]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: [1] events stream  [2] epoch hash  [3] request meta
# ARGV: [1] epoch  [2] ttl s  [3] event bytes
# Returns 1 when written, 0 when a newer dispatch owns the request.
_FENCED_XADD = """
local epoch = tonumber(ARGV[1])
local fence = tonumber(redis.call('HGET', KEYS[2], 'fence') or '0')
if epoch < fence then return 0 end
if epoch > fence then redis.call('HSET', KEYS[2], 'fence', ARGV[1]) end
redis.call('XADD', KEYS[1], '*', '%(event_field)s', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], ARGV[2]) end
return 1
""" % {"event_field": queue.EVENT_FIELD}


def epoch_key(item: queue_pb2.WorkItem) -> str:
    return keys.request_epoch(item.tenant, item.request_id)


async def issue(redis: redis_client.AnyRedis, items: Sequence[queue_pb2.WorkItem], ttl_s: int) -> None:
    """Give each item a new dispatch_epoch (one round trip for all)."""
    if not items:
        return
    pipe = redis.pipeline(transaction=False)
    for item in items:
        pipe.eval(_ISSUE, 1, epoch_key(item), ttl_s)
    replies = await pipe.execute()
    for item, epoch in zip(items, replies):
        item.dispatch_epoch = int(epoch)


async def raise_fence(redis: redis_client.AnyRedis, items: Sequence[queue_pb2.WorkItem], ttl_s: int) -> None:
    """Refuse writes of older epochs of these (dispatched) items from now on."""
    if not items:
        return
    pipe = redis.pipeline(transaction=False)
    for item in items:
        pipe.eval(_RAISE, 1, epoch_key(item), item.dispatch_epoch, ttl_s)
    await pipe.execute()


def fenced_xadd(pipe, item: queue_pb2.WorkItem, event: queue_pb2.TokenEvent, ttl_s: int) -> None:
    """Queue an event write that Redis refuses (reply 0) when `item`'s dispatch was superseded."""
    pipe.eval(_FENCED_XADD, 3, item.events_key, epoch_key(item), keys.request_meta(item.tenant, item.request_id),
              item.dispatch_epoch, ttl_s, event.SerializeToString())
