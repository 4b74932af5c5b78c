"""WRONGTYPE is no outage (llmserve/runtime/redis_client.py): a key llmserve owns holding another type is
not retried as if Redis were down, it fails the loop that met it at once, naming the error. On a
real Valkey, the workers hash written as a string: the worker's heartbeat task raises on its first
beat (with a give-up time far beyond the test's), and a `python -m batcher` process fails (exit 1,
the error logged) instead of retrying its batch loop for good."""

from __future__ import annotations

import asyncio

import pytest
import queue_harness as h

from gpu_worker.engine.engine import EngineStats
from gpu_worker.heartbeat import Heartbeat
from llmserve.local.stack import ServiceProcess
from llmserve.protocol import keys
from llmserve.runtime import redis_client

pytestmark = pytest.mark.timeout(120)

IDLE = EngineStats(running=0, waiting=0, free_blocks=8, total_blocks=8, kv_usage=0.0, steps=0, generated_tokens=0,
                   last_batch_tokens=0, preemptions=0, prefix_hit_rate=0.0)


def test_a_wrongtype_reply_is_not_an_outage():
    wrong = redis_client.redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
    assert redis_client.is_wrong_type(wrong)
    assert not isinstance(wrong, redis_client.UNAVAILABLE_ERRORS)
    assert not redis_client.is_wrong_type(redis_client.redis.exceptions.ResponseError("NOGROUP No such key"))


async def test_the_heartbeat_fails_at_once_on_a_workers_hash_of_the_wrong_type(redis_url, clean_redis):
    clean_redis.set(keys.workers_hash(h.MODEL), "not a hash")
    client = redis_client.connect(redis_url)
    beat = Heartbeat(client, h.MODEL, "w-wrongtype", "127.0.0.1:1", 0.05, 16, 4, snapshot=lambda: IDLE,
                     draining=lambda: False, give_up_s=3600.0)
    try:
        with pytest.raises(redis_client.redis.exceptions.ResponseError) as failed:
            async with asyncio.timeout(60):
                await beat.run()
    finally:
        await client.aclose()
    assert redis_client.is_wrong_type(failed.value)


def test_the_batcher_process_fails_instead_of_retrying_a_key_of_the_wrong_type(redis_url, clean_redis, tmp_path):
    clean_redis.set(keys.workers_hash(h.MODEL), "not a hash")
    batcher = ServiceProcess("batcher", "batcher", ["--redis-url", redis_url, "--models", h.MODEL], 0,
                             tmp_path / "batcher.log", None).start()
    try:
        assert batcher.wait(90) == 1
    finally:
        batcher.stop(5)
    log = batcher.log_tail(200)
    assert "task died; failing the service" in log and "WRONGTYPE" in log, log[-3000:]
