"""Queue cells against real Valkey: live-worker counts, a worker's join, the gateway's cell choice and
its load shedding over every cell (llmserve/protocol/queue_cells.py, gateway/shedding.py)."""

from __future__ import annotations

import pytest
import queue_harness as h

from gateway.shedding import Shedder
from llmserve.protocol import keys, queue_cells
from llmserve.runtime import redis_client
from llmserve.runtime.errors import Unavailable
from llmserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def redis(redis_url, clean_redis):
    client = redis_client.connect(redis_url)
    yield client
    await client.aclose()


async def test_only_live_undraining_workers_count(redis, clean_redis):
    h.heartbeat(clean_redis, "live", shard=1)
    h.heartbeat(clean_redis, "silent", shard=0, sent_unix_ms=h.now_ms() - 60_000)
    h.heartbeat(clean_redis, "draining", shard=2, draining=True)
    clean_redis.hset(keys.workers_hash(h.MODEL, 2), "garbage", b"\xff\x00 not a heartbeat")
    assert await queue_cells.live_workers(redis, h.MODEL, 3) == [0, 1, 0]
    chooser = queue_cells.CellChooser(redis, 3)
    assert {await chooser.choose(h.MODEL, f"t:r{i}") for i in range(50)} == {1}


async def test_workers_joining_together_take_different_cells(redis, clean_redis):
    joined = [await queue_cells.join(redis, h.MODEL, 3) for _ in range(3)]   # none heartbeats yet
    assert sorted(joined) == [0, 1, 2]
    assert await queue_cells.join(redis, h.MODEL, 1) == 0                  # one cell: no Redis at all


async def test_shedding_counts_the_queue_of_every_cell(redis, clean_redis):
    shedder = Shedder(redis, max_depth=10, high_reserved_share=0.2, queue_shards=3)   # anyone below 8
    for shard, n in ((0, 2), (2, 5)):
        for _ in range(n):
            clean_redis.xadd(keys.work_stream(h.MODEL, pb.PRIORITY_LOW, shard), {"filler": "1"})
    assert await shedder.depth(h.MODEL) == 7
    await shedder.check(h.MODEL, pb.PRIORITY_NORMAL, "t")
    clean_redis.xadd(keys.work_stream(h.MODEL, pb.PRIORITY_NORMAL, 1), {"filler": "1"})
    with pytest.raises(Unavailable, match="overloaded"):
        await shedder.check(h.MODEL, pb.PRIORITY_NORMAL, "t")
    await shedder.check(h.MODEL, pb.PRIORITY_HIGH, "t")                    # the reserved share
