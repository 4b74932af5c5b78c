"""The batcher's stats task against real Valkey: an entry that does not decode at the head of a work
stream (delivered to another replica, so this one's batch loop never drops it) leaves the task
running and the gauges updating; the task is supervised under its name."""

from __future__ import annotations

import asyncio

import pytest
import queue_harness as h
from prometheus_client import REGISTRY

from batcher.config import BatcherSettings
from batcher.service import BatcherService
from llmserve.protocol import keys
from llmserve.v1 import inference_pb2

pytestmark = pytest.mark.timeout(60)

NORMAL = inference_pb2.PRIORITY_NORMAL


def depth() -> float:
    labels = {"model": h.MODEL, "priority": keys.priority_name(NORMAL), "shard": "0"}
    return REGISTRY.get_sample_value("llmserve_batcher_queue_depth", labels) or 0.0


async def until(fn, timeout: float = 15.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not fn():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_poison_entry_at_a_stream_head_leaves_the_stats_task_running(redis_url, clean_redis):
    stream = keys.work_stream(h.MODEL, NORMAL)
    clean_redis.xgroup_create(stream, keys.WORK_GROUP, id="0", mkstream=True)
    clean_redis.xadd(stream, {"garbage": b"\xff\x00"})
    clean_redis.xreadgroup(keys.WORK_GROUP, "other-replica", {stream: ">"}, count=1)   # held elsewhere
    settings = BatcherSettings(redis_url=redis_url, models=h.MODEL, stats_interval_ms=20, claim_idle_ms=600_000)
    settings.validate()
    service = BatcherService(settings)
    await service.start()
    try:
        assert sorted(service.tasks.names()) == ["batch-m-0", "batcher-stats"]
        await until(lambda: depth() == 1.0, what="the poison entry counted")
        h.enqueue(clean_redis, h.make_item("after-poison"))    # held: no worker heartbeats
        await until(lambda: depth() == 2.0, what="the gauge updated past the poison entry")
        assert "batcher-stats" in service.tasks and service.failure is None
    finally:
        await service.drain()
        await service.close()
