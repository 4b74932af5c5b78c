"""Queue cells (llmserve/protocol/keys.py, queue_shards > 1): each cell's batch loop serves only its own
workers, and a cell left without a live worker hands its work to a cell that has one
(batcher/rehome.py). In-process batcher against real Valkey; the test plays the workers."""

from __future__ import annotations

import pytest
import queue_harness as h
from test_batcher_batching import start_batcher, until  # noqa: F401

from llmserve.protocol import keys

pytestmark = pytest.mark.timeout(90)
CELLS = dict(queue_shards=2, max_batch=8, max_wait_ms=10.0, inbox_claim_idle_ms=0)


async def collect(client, worker_id: str, shard: int, n_items: int) -> list:
    batches = []

    def step():
        batches.extend(b for _, b in h.read_inbox(client, worker_id, shard=shard))
        return sum(len(b.items) for b in batches) >= n_items

    await until(step, what=f"{n_items} items in {worker_id}'s inbox (cell {shard})")
    return batches


def request_ids(batches) -> set[str]:
    return {i.request_id for b in batches for i in b.items}


async def test_each_cell_dispatches_only_to_its_own_workers(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w0", shard=0)
    h.heartbeat(clean_redis, "w1", shard=1)
    await start_batcher(**CELLS)
    h.enqueue(clean_redis, *[h.make_item(f"a{i}") for i in range(4)], shard=0)
    h.enqueue(clean_redis, *[h.make_item(f"b{i}") for i in range(4)], shard=1)
    assert request_ids(await collect(clean_redis, "w0", 0, 4)) == {f"a{i}" for i in range(4)}
    assert request_ids(await collect(clean_redis, "w1", 1, 4)) == {f"b{i}" for i in range(4)}
    assert h.read_inbox(clean_redis, "w0", shard=0) == [] and h.read_inbox(clean_redis, "w1", shard=1) == []
    assert keys.queue_tag(h.MODEL, 0) != keys.queue_tag(h.MODEL, 1)


async def test_a_cell_without_workers_keeps_its_items_until_another_cell_has_one(start_batcher, clean_redis):
    await start_batcher(**CELLS)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}") for i in range(5)], shard=1)
    await until(lambda: clean_redis.xpending(keys.work_stream(h.MODEL, 2, 1), keys.WORK_GROUP)["pending"] == 5,
                what="cell 1 holds the items")
    assert h.pending_work(clean_redis, shard=1) == 5     # no live worker anywhere: nothing moves
    h.heartbeat(clean_redis, "w0", shard=0)
    moved = await collect(clean_redis, "w0", 0, 5)
    assert request_ids(moved) == {f"r{i}" for i in range(5)}
    await until(lambda: h.pending_work(clean_redis, shard=1) == 0, what="cell 1 emptied")
    assert h.pending_work(clean_redis, shard=0) == 0


async def test_a_dead_workers_batches_move_to_a_live_cell(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "doomed", shard=1)
    await start_batcher(**CELLS)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}") for i in range(4)], shard=1)
    taken = await collect(clean_redis, "doomed", 1, 4)         # the worker took the batch ...
    h.heartbeat(clean_redis, "doomed", shard=1, sent_unix_ms=h.now_ms() - 60_000)   # ... and died
    h.heartbeat(clean_redis, "w0", shard=0)
    moved = await collect(clean_redis, "w0", 0, 4)
    assert request_ids(moved) == request_ids(taken)
    assert {i.deliveries for b in moved for i in b.items} == {1}   # counted toward max_deliveries
    inbox = keys.inbox_stream(h.MODEL, "doomed", 1)
    await until(lambda: clean_redis.xlen(inbox) == 0, what="dead inbox emptied")
    assert clean_redis.xpending(inbox, keys.INBOX_GROUP)["pending"] == 0
