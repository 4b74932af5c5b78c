"""Batching, fairness, priority, capacity, drops: an in-process batcher against real Valkey.

The test plays the gateway (enqueue) and the workers (heartbeats, reading
inboxes) through batcher.harness, which speaks the queue protocol.
"""

from __future__ import annotations

import asyncio

import pytest
import queue_harness as h
from prometheus_client import REGISTRY

from batcher.config import BatcherSettings
from batcher.service import BatcherService
from llmserve.protocol import keys, queue
from llmserve.protocol.prefix_hash import block_hashes
from llmserve.v1 import inference_pb2

pytestmark = pytest.mark.timeout(60)


async def until(fn, timeout: float = 15.0, what: str = "condition"):
    """Poll `fn` (sync) until it returns something truthy; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = fn()
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def collect(client, worker_id: str, n_items: int, timeout: float = 15.0) -> list:
    """Read the worker's inbox until `n_items` items arrived; returns the batches in order."""
    batches = []

    def step():
        batches.extend(b for _, b in h.read_inbox(client, worker_id))
        return sum(len(b.items) for b in batches) >= n_items

    await until(step, timeout, f"{n_items} items in {worker_id}'s inbox")
    return batches


@pytest.fixture
async def start_batcher(redis_url, clean_redis):
    started: list[BatcherService] = []

    async def start(**overrides) -> BatcherService:
        values = dict(redis_url=redis_url, models=h.MODEL, max_batch=8, max_wait_ms=20.0,
                      reclaim_interval_ms=100, workers_poll_ms=20, heartbeat_ttl_ms=2000)
        values.update(overrides)
        settings = BatcherSettings(**values)
        settings.validate()
        service = BatcherService(settings)
        await service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        await service.drain()
        await service.close()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": h.MODEL, **labels}) or 0.0


def ids(batches) -> list[list[str]]:
    return [[i.request_id for i in b.items] for b in batches]


async def test_full_batch_leaves_without_waiting(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=4, max_wait_ms=600_000.0)  # the wait alone would never end the test
    h.enqueue(clean_redis, *[h.make_item(f"r{i}") for i in range(8)])
    batches = await collect(clean_redis, "w1", 8)
    assert ids(batches) == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"]]


async def test_partial_batch_leaves_after_max_wait(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=32, max_wait_ms=200.0)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}") for i in range(3)])
    batches = await collect(clean_redis, "w1", 3)
    assert ids(batches) == [["r0", "r1", "r2"]]
    assert h.pending_work(clean_redis) == 0  # acked and deleted from the work stream


async def test_prefill_token_budget_splits_batches(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=32, max_wait_ms=600_000.0, prefill_token_budget=100)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}", prompt_len=40) for i in range(5)])
    # 2 x 40 fit in 100 tokens; the budget being reached makes a batch "full" without waiting.
    batches = await collect(clean_redis, "w1", 4)
    assert ids(batches)[:2] == [["r0", "r1"], ["r2", "r3"]]


async def test_flooding_tenant_does_not_delay_another(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=8, max_wait_ms=600_000.0)
    flood = [h.make_item(f"a{i}", tenant="a") for i in range(500)]
    h.enqueue(clean_redis, *flood, h.make_item("b0", tenant="b"))
    batches = await collect(clean_redis, "w1", 16)
    first_two = ids(batches)[0] + ids(batches)[1]
    assert "b0" in first_two
    a_order = [r for b in ids(batches) for r in b if r.startswith("a")]
    assert a_order == [f"a{i}" for i in range(len(a_order))]  # a tenant's own items stay in order


async def test_strict_priority_order(start_batcher, clean_redis):
    await start_batcher(max_batch=4, max_wait_ms=10.0)
    items = []
    for i in range(4):  # interleaved arrival: low, normal, high, ...
        items += [h.make_item(f"low{i}", priority=inference_pb2.PRIORITY_LOW),
                  h.make_item(f"norm{i}", priority=inference_pb2.PRIORITY_NORMAL),
                  h.make_item(f"high{i}", priority=inference_pb2.PRIORITY_HIGH)]
    h.enqueue(clean_redis, *items)
    await asyncio.sleep(0.3)  # no worker yet: everything is read ahead and held
    assert h.peek_inbox(clean_redis, "w1") == []
    h.heartbeat(clean_redis, "w1")
    batches = await collect(clean_redis, "w1", 12)
    assert ids(batches) == [[f"high{i}" for i in range(4)], [f"norm{i}" for i in range(4)],
                            [f"low{i}" for i in range(4)]]


async def test_expired_item_dropped_with_deadline_event(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=8, max_wait_ms=50.0)
    drops_before = metric("llmserve_batcher_drops_total", reason="deadline")
    sent_before = metric("llmserve_batcher_dispatched_items_total")
    expired = h.make_item("late", deadline_unix_ms=h.now_ms() - 1)
    alive = h.make_item("ok", deadline_unix_ms=h.now_ms() + 600_000)
    h.enqueue(clean_redis, expired, alive)
    batches = await collect(clean_redis, "w1", 1)
    assert ids(batches) == [["ok"]]
    event = (await until(lambda: h.events(clean_redis, expired), what="final event"))[0]
    assert (event.final, event.error.code, event.request_id) == (True, "DEADLINE_EXCEEDED", "late")
    assert h.pending_work(clean_redis) == 0
    assert metric("llmserve_batcher_drops_total", reason="deadline") == drops_before + 1
    assert metric("llmserve_batcher_dispatched_items_total") == sent_before + 1


async def test_item_expiring_while_held_is_dropped(start_batcher, clean_redis):
    await start_batcher(max_batch=8, max_wait_ms=10.0)  # no worker: the item waits for capacity
    item = h.make_item("soon", deadline_unix_ms=h.now_ms() + 300)
    h.enqueue(clean_redis, item)
    event = (await until(lambda: h.events(clean_redis, item), what="final event"))[0]
    assert (event.final, event.error.code) == (True, "DEADLINE_EXCEEDED")
    h.heartbeat(clean_redis, "w1")
    await asyncio.sleep(0.3)
    assert h.peek_inbox(clean_redis, "w1") == []
    assert h.pending_work(clean_redis) == 0


async def test_cancelled_item_dropped_with_cancelled_event(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=8, max_wait_ms=50.0)
    cancelled, kept = h.make_item("gone"), h.make_item("kept")
    clean_redis.set(cancelled.cancel_key, b"1")
    h.enqueue(clean_redis, cancelled, kept)
    batches = await collect(clean_redis, "w1", 1)
    assert ids(batches) == [["kept"]]
    event = (await until(lambda: h.events(clean_redis, cancelled), what="final event"))[0]
    assert (event.final, event.finish_reason, event.error.code) == \
        (True, inference_pb2.FINISH_REASON_CANCELLED, "")
    assert h.pending_work(clean_redis) == 0


async def test_cancelled_item_held_without_capacity_is_dropped(start_batcher, clean_redis):
    await start_batcher(max_batch=8, max_wait_ms=10.0)  # no worker: nothing can be dispatched
    item = h.make_item("cancel-while-held")
    h.enqueue(clean_redis, item)
    await asyncio.sleep(0.3)
    clean_redis.set(item.cancel_key, b"1")
    event = (await until(lambda: h.events(clean_redis, item), what="final event"))[0]
    assert (event.final, event.finish_reason) == (True, inference_pb2.FINISH_REASON_CANCELLED)
    assert h.pending_work(clean_redis) == 0


async def test_capacity_never_exceeded_and_draining_or_silent_workers_skipped(start_batcher, clean_redis):
    # 16-token prompt + 16 new tokens = 2 blocks of 16 per item; w1 has room for 5 items.
    h.heartbeat(clean_redis, "w1", free_blocks=10, total_blocks=100)
    h.heartbeat(clean_redis, "drainer", free_blocks=10_000, draining=True)
    h.heartbeat(clean_redis, "silent", free_blocks=10_000, sent_unix_ms=h.now_ms() - 60_000)
    await start_batcher(max_batch=32, max_wait_ms=10.0, capacity_grace_ms=0)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}", prompt_len=16, max_new_tokens=16) for i in range(10)])
    first = await collect(clean_redis, "w1", 5)
    await asyncio.sleep(0.3)  # more heartbeat polls; the ledger must still hold the line
    first += [b for _, b in h.read_inbox(clean_redis, "w1")]
    assert sum(len(b.items) for b in first) == 5
    h.heartbeat(clean_redis, "w1", free_blocks=10, total_blocks=100)  # the worker admitted them
    rest = await collect(clean_redis, "w1", 5)
    assert sorted(r for b in ids(first + rest) for r in b) == sorted(f"r{i}" for i in range(10))
    assert h.peek_inbox(clean_redis, "drainer") == [] and h.peek_inbox(clean_redis, "silent") == []


async def test_prefers_worker_with_most_free_blocks(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "small", free_blocks=100)
    h.heartbeat(clean_redis, "big", free_blocks=1000)
    await start_batcher(max_batch=4, max_wait_ms=10.0)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}") for i in range(4)])
    batches = await collect(clean_redis, "big", 4)
    assert ids(batches) == [["r0", "r1", "r2", "r3"]]
    assert h.peek_inbox(clean_redis, "small") == []


async def test_batch_goes_to_the_worker_with_its_prefix_cached(start_batcher, clean_redis):
    shared = h.make_item("shared", prompt_len=40)          # blocks 1-16 and 17-32 are full
    h.heartbeat(clean_redis, "roomy", free_blocks=1000)
    h.heartbeat(clean_redis, "warm", free_blocks=100,
                cached_prefix_hashes=block_hashes(list(shared.prompt_token_ids), 16))
    await start_batcher(max_batch=4, max_wait_ms=10.0)
    h.enqueue(clean_redis, shared)
    assert ids(await collect(clean_redis, "warm", 1)) == [["shared"]]
    h.enqueue(clean_redis, h.make_item("other", prompt_len=3))    # no full block: most room wins
    assert ids(await collect(clean_redis, "roomy", 1)) == [["other"]]


async def test_request_larger_than_any_worker_fails(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1", free_blocks=4, total_blocks=4)
    await start_batcher(max_batch=4, max_wait_ms=10.0)
    huge, small = h.make_item("huge", prompt_len=200), h.make_item("small")
    h.enqueue(clean_redis, huge, small)
    assert ids(await collect(clean_redis, "w1", 1)) == [["small"]]
    event = (await until(lambda: h.events(clean_redis, huge), what="final event"))[0]
    assert (event.final, event.error.code) == (True, "RESOURCE_EXHAUSTED")


async def test_garbage_heartbeat_and_work_entry_do_not_stop_batching(start_batcher, clean_redis):
    clean_redis.hset(keys.workers_hash(h.MODEL), "broken", b"\xff\xff not a heartbeat")
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=2, max_wait_ms=10.0)
    clean_redis.xadd(keys.work_stream(h.MODEL, inference_pb2.PRIORITY_NORMAL), {queue.ITEM_FIELD: b"\xff\xff garbage"})
    h.enqueue(clean_redis, h.make_item("r0"), h.make_item("r1"))
    assert ids(await collect(clean_redis, "w1", 2)) == [["r0", "r1"]]
    await until(lambda: h.pending_work(clean_redis) == 0, what="garbage entry acked")
    assert h.peek_inbox(clean_redis, "broken") == []
