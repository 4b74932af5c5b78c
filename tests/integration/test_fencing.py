"""Fencing tokens on real Valkey: a write of an older dispatch epoch is refused once a newer
dispatch raised the fence or wrote; event writes renew the request meta's TTL."""

from __future__ import annotations

import pytest

from llmserve.protocol import fencing, keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import queue_pb2

TTL_S = 100


@pytest.fixture
async def redis(redis_url, clean_redis):
    client = redis_client.connect(redis_url)
    yield client
    await client.aclose()


def item(epoch: int = 0) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(request_id="r1", tenant="t", events_key=keys.events_stream("t", "r1"),
                              dispatch_epoch=epoch)


async def write(redis, work_item: queue_pb2.WorkItem, marker: str) -> int:
    """Write an event whose worker_id is `marker`; 1 when Redis took it."""
    pipe = redis.pipeline(transaction=False)
    fencing.fenced_xadd(pipe, work_item, queue_pb2.TokenEvent(request_id="r1", worker_id=marker), TTL_S)
    [written] = await pipe.execute()
    return written


def events(clean_redis) -> list[str]:
    """The markers of the events in the stream, in order."""
    return [queue.decode_event(fields).worker_id for _, fields in clean_redis.xrange(keys.events_stream("t", "r1"))]


async def test_each_dispatch_gets_a_newer_epoch(redis):
    first, second = item(), item()
    await fencing.issue(redis, [first], TTL_S)
    await fencing.issue(redis, [second], TTL_S)
    assert (first.dispatch_epoch, second.dispatch_epoch) == (1, 2)


async def test_raised_fence_refuses_the_older_dispatch(redis, clean_redis):
    old, new = item(1), item(2)
    assert await write(redis, old, "a") == 1
    await fencing.raise_fence(redis, [new], TTL_S)
    assert await write(redis, old, "b") == 0
    assert await write(redis, new, "c") == 1
    assert events(clean_redis) == ["a", "c"]


async def test_first_write_of_a_newer_dispatch_fences_the_older(redis, clean_redis):
    old, new = item(1), item(2)
    assert await write(redis, new, "x") == 1
    assert await write(redis, old, "y") == 0
    assert events(clean_redis) == ["x"]


async def test_a_lost_dispatch_does_not_fence_the_one_that_won(redis, clean_redis):
    """Two batcher replicas issue epochs for one item; only the winner raises the fence."""
    winner, loser = item(), item()
    await fencing.issue(redis, [winner], TTL_S)
    await fencing.issue(redis, [loser], TTL_S)   # the loser's dispatch script then fails
    await fencing.raise_fence(redis, [winner], TTL_S)
    assert await write(redis, winner, "w") == 1


async def test_event_write_keeps_the_request_meta_alive(redis, clean_redis):
    meta = keys.request_meta("t", "r1")
    clean_redis.hset(meta, "owner", "t")
    clean_redis.expire(meta, 5)
    await write(redis, item(1), "e")
    assert clean_redis.ttl(meta) > 5
