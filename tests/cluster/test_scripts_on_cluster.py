"""Every Lua script and MULTI of the queue protocol, run on the real cluster through the
cluster client: the batcher's dispatch/touch, the fencing scripts and the gateway's quota
scripts (with three processes racing on one tenant). These are the integration suite's own
tests, imported; tests/cluster/conftest.py gives them the cluster's `redis_url` and
`clean_redis`, so a script whose keys span slots fails here (the client refuses it, or the
node answers CROSSSLOT)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
from test_batcher_scripts import (  # noqa: E402,F401  (collected and run here, on the cluster)
    scripts,
    test_dispatch_by_a_non_owner_changes_nothing,
    test_dispatch_by_the_owner_moves_items_atomically,
    test_one_foreign_entry_blocks_the_whole_dispatch,
    test_touch_refreshes_own_entries_and_reports_lost_ones,
)
from test_fencing import (  # noqa: E402,F401
    redis,
    test_a_lost_dispatch_does_not_fence_the_one_that_won,
    test_each_dispatch_gets_a_newer_epoch,
    test_event_write_keeps_the_request_meta_alive,
    test_first_write_of_a_newer_dispatch_fences_the_older,
    test_raised_fence_refuses_the_older_dispatch,
)
from test_gateway_quota import (  # noqa: E402,F401
    quota,
    test_64_callers_3_processes_never_exceed_gcra,
    test_64_callers_3_processes_never_exceed_max_concurrent,
    test_gcra_burst_then_rate,
    test_leases_expire_after_kill_9,
    test_tokens_limit_names_limit_and_retry,
)


async def test_drain_handoff_multi_runs_on_the_cluster(redis_url, clean_redis):
    """gpu_worker/handoff.py: one MULTI puts items back on two priorities' work streams and acks
    the inbox entry they came in (one slot: the model's tag)."""
    from gpu_worker.handoff import hand_back
    from llmserve.protocol import keys, queue
    from llmserve.runtime import redis_client
    from llmserve.v1 import inference_pb2, queue_pb2

    inbox = keys.inbox_stream("m", "w1")
    clean_redis.xgroup_create(inbox, keys.INBOX_GROUP, id="0", mkstream=True)
    clean_redis.xadd(inbox, {queue.BATCH_FIELD: b"b"})
    [[_, [(entry, _)]]] = clean_redis.xreadgroup(keys.INBOX_GROUP, "w1", {inbox: ">"}, count=1)
    items = [queue_pb2.WorkItem(request_id=f"r{p}", priority=p)
             for p in (inference_pb2.PRIORITY_HIGH, inference_pb2.PRIORITY_LOW)]
    client = redis_client.connect(redis_url)
    try:
        await hand_back(client, "m", "w1", items, [entry.decode()])
    finally:
        await client.aclose()
    for item in items:
        [(_, fields)] = clean_redis.xrange(keys.work_stream("m", item.priority))
        assert queue.decode_item(fields).request_id == item.request_id
    assert clean_redis.xlen(inbox) == 0 and clean_redis.xpending(inbox, keys.INBOX_GROUP)["pending"] == 0
