"""The Lua scripts on real Valkey: dispatch is all-or-nothing and only for entries we own."""

from __future__ import annotations

import time

import pytest

from batcher.events import DropReason, final_event
from batcher.scripts import Scripts, Source
from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import inference_pb2, queue_pb2

STREAM, INBOX, INBOXES = keys.work_stream("m", 2), keys.inbox_stream("m", "w1"), keys.inboxes_set("m")


@pytest.fixture
async def scripts(redis_url, clean_redis):
    client = redis_client.connect(redis_url)
    loaded = Scripts(client)
    await loaded.load()
    yield loaded
    await client.aclose()


def read_two(clean_redis, consumer: str) -> list[str]:
    clean_redis.xgroup_create(STREAM, keys.WORK_GROUP, id="0", mkstream=True)
    for i in range(2):
        clean_redis.xadd(STREAM, {queue.ITEM_FIELD: f"item{i}".encode()})
    reply = clean_redis.xreadgroup(keys.WORK_GROUP, consumer, {STREAM: ">"}, count=10)
    return [entry_id.decode() for entry_id, _ in reply[0][1]]


async def test_dispatch_by_a_non_owner_changes_nothing(scripts, clean_redis):
    ids = read_two(clean_redis, "a")
    result = await scripts.dispatch(INBOX, INBOXES, "w1", keys.INBOX_GROUP, "b",
                                    [Source(STREAM, keys.WORK_GROUP, ids)], b"batch")
    assert (result.ok, sorted(result.lost)) == (False, sorted((STREAM, i) for i in ids))
    assert not clean_redis.exists(INBOX) and clean_redis.xlen(STREAM) == 2
    assert clean_redis.xpending(STREAM, keys.WORK_GROUP)["pending"] == 2


async def test_dispatch_by_the_owner_moves_items_atomically(scripts, clean_redis):
    ids = read_two(clean_redis, "a")
    result = await scripts.dispatch(INBOX, INBOXES, "w1", keys.INBOX_GROUP, "a",
                                    [Source(STREAM, keys.WORK_GROUP, ids)], b"batch")
    assert result.ok and result.inbox_entry
    assert [fields for _, fields in clean_redis.xrange(INBOX)] == [{queue.BATCH_FIELD.encode(): b"batch"}]
    assert clean_redis.xinfo_groups(INBOX)[0]["name"] == keys.INBOX_GROUP.encode()  # created from id 0
    assert clean_redis.smembers(INBOXES) == {b"w1"}
    assert clean_redis.xlen(STREAM) == 0 and clean_redis.xpending(STREAM, keys.WORK_GROUP)["pending"] == 0


async def test_one_foreign_entry_blocks_the_whole_dispatch(scripts, clean_redis):
    ids = read_two(clean_redis, "a")
    clean_redis.xclaim(STREAM, keys.WORK_GROUP, "b", 0, [ids[1]])  # another replica took one over
    result = await scripts.dispatch(INBOX, INBOXES, "w1", keys.INBOX_GROUP, "a",
                                    [Source(STREAM, keys.WORK_GROUP, ids)], b"batch")
    assert (result.ok, result.lost) == (False, ((STREAM, ids[1]),))
    assert not clean_redis.exists(INBOX) and clean_redis.xlen(STREAM) == 2


async def test_touch_refreshes_own_entries_and_reports_lost_ones(scripts, clean_redis):
    ids = read_two(clean_redis, "a")
    time.sleep(0.2)
    clean_redis.xclaim(STREAM, keys.WORK_GROUP, "b", 0, [ids[1]])
    assert await scripts.touch(STREAM, keys.WORK_GROUP, "a", ids) == [ids[1]]
    pending = clean_redis.xpending_range(STREAM, keys.WORK_GROUP, "-", "+", 10)
    owners = {p["message_id"].decode(): (p["consumer"].decode(), p["time_since_delivered"]) for p in pending}
    assert owners[ids[0]][0] == "a" and owners[ids[0]][1] < 200 and owners[ids[1]][0] == "b"


def test_final_events_carry_the_right_status():
    item = queue_pb2.WorkItem(request_id="r", prompt_token_ids=[1, 2, 3], generated_token_ids=[9])
    cancelled = final_event(item, DropReason.CANCELLED)
    assert (cancelled.final, cancelled.index, cancelled.finish_reason, cancelled.error.code) == \
        (True, 1, inference_pb2.FINISH_REASON_CANCELLED, "")
    codes = {r: final_event(item, r).error.code for r in (DropReason.DEADLINE, DropReason.POISON,
                                                          DropReason.TOO_LARGE)}
    assert codes == {DropReason.DEADLINE: "DEADLINE_EXCEEDED", DropReason.POISON: "UNAVAILABLE",
                     DropReason.TOO_LARGE: "RESOURCE_EXHAUSTED"}
