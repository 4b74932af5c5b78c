"""Loss-free and duplicate-free: reclaims from silent batchers and dead workers, poison items,
two replicas on one queue. In-process batchers against real Valkey; the test plays the workers."""

from __future__ import annotations

import asyncio
import collections

import pytest
import queue_harness as h
from test_batcher_batching import collect, ids, start_batcher, until  # noqa: F401

from llmserve.protocol import keys

pytestmark = pytest.mark.timeout(90)


def dead(client, worker_id: str) -> None:
    """The worker stops heartbeating: its last heartbeat is a minute old."""
    h.heartbeat(client, worker_id, sent_unix_ms=h.now_ms() - 60_000)


async def test_items_pending_on_a_silent_batcher_are_reclaimed(start_batcher, clean_redis):
    stream = keys.work_stream(h.MODEL, 2)
    clean_redis.xgroup_create(stream, keys.WORK_GROUP, id="0", mkstream=True)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}") for i in range(5)])
    # A batcher that read the items and died before dispatching them.
    got = clean_redis.xreadgroup(keys.WORK_GROUP, "ghost", {stream: ">"}, count=100)
    assert len(got[0][1]) == 5
    h.heartbeat(clean_redis, "w1")
    await start_batcher(max_batch=8, max_wait_ms=10.0, claim_idle_ms=300)
    batches = await collect(clean_redis, "w1", 5)
    assert sorted(r for b in ids(batches) for r in b) == [f"r{i}" for i in range(5)]
    assert h.pending_work(clean_redis) == 0
    assert clean_redis.xpending(stream, keys.WORK_GROUP)["pending"] == 0


async def test_dead_worker_inbox_redispatched_to_live_worker(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "doomed")
    await start_batcher(max_batch=4, max_wait_ms=10.0, inbox_claim_idle_ms=0)
    h.enqueue(clean_redis, *[h.make_item(f"r{i}") for i in range(4)])
    read = await collect(clean_redis, "doomed", 4)        # the worker took the batch ...
    h.enqueue(clean_redis, *[h.make_item(f"s{i}") for i in range(4)])
    await until(lambda: len(h.peek_inbox(clean_redis, "doomed")) == 2, what="second batch")
    dead(clean_redis, "doomed")                            # ... and died; the second batch was never read
    h.heartbeat(clean_redis, "alive")
    moved = await collect(clean_redis, "alive", 8)
    by_id = {i.request_id: i.deliveries for b in moved for i in b.items}
    assert by_id == {**{f"r{i}": 1 for i in range(4)}, **{f"s{i}": 0 for i in range(4)}}
    assert ids(read) == [["r0", "r1", "r2", "r3"]]
    inbox = keys.inbox_stream(h.MODEL, "doomed")
    await until(lambda: clean_redis.xlen(inbox) == 0, what="dead inbox emptied")
    assert clean_redis.xpending(inbox, keys.INBOX_GROUP)["pending"] == 0


async def test_poison_item_fails_after_max_deliveries(start_batcher, clean_redis):
    await start_batcher(max_batch=4, max_wait_ms=10.0, inbox_claim_idle_ms=0, max_deliveries=2)
    h.heartbeat(clean_redis, "w1")
    poison = h.make_item("poison")
    h.enqueue(clean_redis, poison)
    for victim, successor in (("w1", "w2"), ("w2", "w3")):
        [batch] = await collect(clean_redis, victim, 1)   # each worker that reads it dies
        assert ids([batch]) == [["poison"]]
        h.heartbeat(clean_redis, successor)
        dead(clean_redis, victim)
    event = (await until(lambda: h.events(clean_redis, poison), what="final event"))[0]
    assert (event.final, event.error.code) == (True, "UNAVAILABLE")
    await asyncio.sleep(0.3)
    assert h.peek_inbox(clean_redis, "w3") == []
    assert clean_redis.xlen(keys.inbox_stream(h.MODEL, "w2")) == 0


async def test_worker_death_every_item_gets_exactly_one_final_result(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "a")
    await start_batcher(max_batch=8, max_wait_ms=5.0, inbox_claim_idle_ms=0)
    items = [h.make_item(f"r{i}", tenant=f"t{i % 3}") for i in range(60)]
    h.enqueue(clean_redis, *items)
    got = await collect(clean_redis, "a", 60)
    for entry_id, batch in zip(clean_redis.xrange(keys.inbox_stream(h.MODEL, "a")), got[:3]):
        h.finish(clean_redis, "a", entry_id[0].decode(), batch)  # a finishes 3 batches, then dies
    dead(clean_redis, "a")
    h.heartbeat(clean_redis, "b")

    def b_done():
        for entry_id, batch in h.read_inbox(clean_redis, "b"):
            h.finish(clean_redis, "b", entry_id, batch)
        return all(h.events(clean_redis, i) for i in items)

    await until(b_done, what="every item finished")
    await asyncio.sleep(0.5)  # any late duplicate would show up now
    b_done()
    finals = {i.request_id: [e.worker_id for e in h.events(clean_redis, i) if e.final] for i in items}
    assert all(len(workers) == 1 for workers in finals.values()), finals
    assert collections.Counter(w[0] for w in finals.values()) == {"a": 24, "b": 36}


async def test_two_batchers_never_dispatch_an_item_twice(start_batcher, clean_redis):
    h.heartbeat(clean_redis, "w1")
    h.heartbeat(clean_redis, "w2")
    for _ in range(2):  # short claim idle: the replicas also reclaim (and touch) each other's items
        await start_batcher(max_batch=8, max_wait_ms=2.0, claim_idle_ms=200)
    items = [h.make_item(f"r{i}", tenant=f"t{i % 5}") for i in range(2000)]
    for i in range(0, len(items), 100):
        h.enqueue(clean_redis, *items[i:i + 100])
        await asyncio.sleep(0.01)
    seen: list[str] = []

    def step():
        for worker in ("w1", "w2"):
            h.heartbeat(clean_redis, worker)
            seen.extend(r.request_id for _, b in h.read_inbox(clean_redis, worker) for r in b.items)
        return len(seen) >= 2000

    await until(step, 30, "2000 items dispatched")
    await asyncio.sleep(1.0)
    step()
    assert len(seen) == 2000 and sorted(seen) == sorted(i.request_id for i in items)
    assert h.pending_work(clean_redis) == 0
