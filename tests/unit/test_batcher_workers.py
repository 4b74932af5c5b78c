"""WorkerPool: liveness, draining, capacity ledger, block estimates. No servers."""

from __future__ import annotations

from batcher.batch_budget import BatchBudget
from batcher.config import BatchLimits
from batcher.fair_queue import Held
from batcher.workers import Capacity, WorkerPool, blocks_needed, cached_run, leading_hashes
from llmserve.protocol.prefix_hash import block_hashes
from llmserve.v1 import inference_pb2, queue_pb2

HIGH, NORMAL = inference_pb2.PRIORITY_HIGH, inference_pb2.PRIORITY_NORMAL


def hb(worker_id: str, sent: int, free: int = 100, running: int = 0, max_running: int = 8,
       draining: bool = False, block_size: int = 16, cached: list[int] = ()) -> queue_pb2.WorkerHeartbeat:
    return queue_pb2.WorkerHeartbeat(worker_id=worker_id, free_blocks=free, total_blocks=free,
                                     block_size=block_size, running=running, max_running=max_running,
                                     draining=draining, sent_unix_ms=sent, cached_prefix_hashes=cached)


def test_blocks_needed_counts_prompt_generated_and_reserved_decode():
    item = queue_pb2.WorkItem(prompt_token_ids=list(range(20)), generated_token_ids=[1, 2],
                              sampling=queue_pb2.ResolvedSampling(max_new_tokens=40))
    assert blocks_needed(item, 16, 1.0) == 4   # ceil(62 / 16)
    assert blocks_needed(item, 16, 0.0) == 2   # ceil(22 / 16): prompt only
    assert blocks_needed(item, 16, 0.5) == 3   # ceil(42 / 16)
    assert blocks_needed(item, 0, 1.0) == 0


def test_silent_and_draining_workers_get_nothing():
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"old": hb("old", sent=0, free=1000), "drain": hb("drain", sent=9_500, free=1000, draining=True),
                 "ok": hb("ok", sent=9_500, free=10)})
    assert [c.worker_id for c in pool.accepting(10_000)] == ["ok"]
    assert pool.is_alive("drain", 10_000) and not pool.is_alive("old", 10_000)
    assert not pool.is_alive("missing", 10_000)


def test_most_free_blocks_first_and_full_workers_skipped():
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"a": hb("a", 100, free=50), "b": hb("b", 100, free=80, running=8), "c": hb("c", 100, free=60)})
    assert [c.worker_id for c in pool.accepting(100)] == ["b", "c", "a"]
    assert pool.choose(None, 100, 0.0).worker_id == "c"  # b has no sequence slot left


def test_reservations_hold_until_a_newer_heartbeat_beyond_grace():
    pool = WorkerPool(heartbeat_ttl_ms=10_000, grace_ms=100)
    pool.update({"w": hb("w", sent=1000, free=100, max_running=10)})
    pool.reserve("w", blocks=30, seqs=3, now_ms=1050)
    cap = pool.choose(None, 1060, 0.0)
    assert (cap.free_blocks, cap.free_seqs) == (70, 7)
    pool.update({"w": hb("w", sent=1100, free=100, max_running=10)})  # within grace: still reserved
    assert pool.choose(None, 1110, 0.0).free_blocks == 70
    pool.update({"w": hb("w", sent=1200, free=75, running=3, max_running=10)})  # the worker counts them now
    cap = pool.choose(None, 1210, 0.0)
    assert (cap.free_blocks, cap.free_seqs) == (75, 7)


def test_unreported_max_running_does_not_limit_sequences():
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"w": hb("w", sent=100, max_running=0)})
    assert pool.choose(None, 100, 0.0).free_seqs > 10**6


SYSTEM = list(range(1000, 1040))   # a shared 40-token system prompt: 2 full blocks of 16


def chat_item(user: list[int], max_new: int = 16) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(prompt_token_ids=SYSTEM + user, sampling=queue_pb2.ResolvedSampling(max_new_tokens=max_new))


def test_cached_run_counts_the_leading_run_only():
    h = block_hashes(SYSTEM + [1] * 24, 16)                      # 4 blocks
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"w": hb("w", 100, cached=[h[0], h[1], h[3]])})  # block 2 evicted: the run stops there
    [cap] = pool.accepting(100)
    assert cached_run(leading_hashes(chat_item([1] * 24), 16), cap) == 2
    assert cached_run(leading_hashes(chat_item([2] * 24), 16), cap) == 2   # same system prompt, other user text
    assert cached_run(leading_hashes(queue_pb2.WorkItem(prompt_token_ids=[5] * 64), 16), cap) == 0


def test_dispatch_hashes_under_the_items_cache_salt():
    """A worker caching tenant A's system prompt is no prefix match for tenant B's identical one."""
    def salted(salt: str) -> queue_pb2.WorkItem:
        item = chat_item([7, 8, 9])
        item.cache_salt = salt
        return item

    h = block_hashes(SYSTEM, 16, "tenant:a")
    assert leading_hashes(salted("tenant:a"), 16) == h
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"roomy": hb("roomy", 100, free=500), "warm": hb("warm", 100, free=50, cached=h)})
    assert pool.choose(salted("tenant:a"), 100, 1.0).worker_id == "warm"
    assert pool.choose(salted("tenant:b"), 100, 1.0).worker_id == "roomy"
    assert pool.choose(salted(""), 100, 1.0).worker_id == "roomy"


def test_batch_goes_where_its_prefix_is_cached_if_it_fits():
    h = block_hashes(SYSTEM, 16)
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"roomy": hb("roomy", 100, free=500), "warm": hb("warm", 100, free=50, cached=h),
                 "half": hb("half", 100, free=400, cached=h[:1])})
    assert pool.choose(chat_item([7, 8, 9]), 100, 1.0).worker_id == "warm"
    assert pool.choose(queue_pb2.WorkItem(prompt_token_ids=[3] * 40), 100, 1.0).worker_id == "roomy"
    # too big for the warm worker's free blocks: the longest run among those it fits
    assert pool.choose(chat_item([7] * 900), 100, 0.0).worker_id == "half"


def test_a_much_busier_worker_loses_its_prefix_preference():
    h = block_hashes(SYSTEM, 16)
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"warm": hb("warm", 100, free=300, running=28, max_running=32, cached=h),
                 "idle": hb("idle", 100, free=400, max_running=32)})
    assert pool.choose(chat_item([7]), 100, 1.0).worker_id == "idle"     # 4 free slots against 32
    pool.update({"warm": hb("warm", 100, free=300, running=12, max_running=32, cached=h),
                 "idle": hb("idle", 100, free=400, max_running=32)})
    assert pool.choose(chat_item([7]), 100, 1.0).worker_id == "warm"     # 20 against 32: close enough


def full(worker_id: str, free: int, preemptible_seqs: int, preemptible_blocks: int) -> queue_pb2.WorkerHeartbeat:
    beat = hb(worker_id, 100, free=free, running=8)
    beat.preemptible_seqs, beat.preemptible_blocks = preemptible_seqs, preemptible_blocks
    return beat


def item(priority: int, prompt: int = 32) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(priority=priority, prompt_token_ids=list(range(prompt)),
                              sampling=queue_pb2.ResolvedSampling(max_new_tokens=16))


def test_high_goes_to_the_full_worker_where_it_preempts_least():
    pool = WorkerPool(heartbeat_ttl_ms=1000, grace_ms=0)
    pool.update({"only-high": full("only-high", 50, 0, 0), "tight": full("tight", 0, 2, 6),
                 "roomy": full("roomy", 10, 1, 2)})
    assert pool.choose(item(HIGH), 100, 0.0).worker_id == "roomy"      # free blocks: fewest evictions
    assert pool.choose(item(NORMAL), 100, 0.0) is None                  # nobody preempts for NORMAL
    pool.update({"only-high": full("only-high", 50, 0, 0), "tight": full("tight", 0, 2, 6)})
    assert pool.choose(item(HIGH), 100, 0.0).worker_id == "tight"
    assert pool.choose(item(HIGH, prompt=200), 100, 0.0) is None        # 13 blocks: preemption frees 6


def test_a_high_budget_spends_free_room_then_preemptible_room():
    cap = Capacity("w", free_blocks=2, free_seqs=1, block_size=16, total_blocks=64, preemptible_seqs=2,
                   preemptible_blocks=4)
    budget = BatchBudget(BatchLimits(max_batch=8, max_wait_ms=1, prefill_token_budget=10_000), 0.0, cap, 64, 0)
    admitted = [budget.admit(Held("s", str(i), item(HIGH), 0.0)) for i in range(4)]
    assert admitted == [True, True, True, False]    # 1 free slot + 2 preemptible; 2 + 4 blocks
    assert budget.admit(Held("s", "n", item(NORMAL, prompt=1), 0.0)) is False
