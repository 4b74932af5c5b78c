"""FairQueue: strict priority, token-fair (VTC) across tenants, budgets, dedupe. No servers."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from batcher.fair_queue import FairQueue, Held
from llmserve.v1 import inference_pb2, queue_pb2

HIGH, NORMAL, LOW = inference_pb2.PRIORITY_HIGH, inference_pb2.PRIORITY_NORMAL, inference_pb2.PRIORITY_LOW


def make_held(request_id: str, tenant: str = "t", priority: int = NORMAL, prompt_len: int = 4,
              read_at: float = 0.0, entry_id: str | None = None, max_new: int = 0, weight: float = 0.0,
              generated: int = 0) -> Held:
    item = queue_pb2.WorkItem(request_id=request_id, tenant=tenant, priority=priority,
                              prompt_token_ids=list(range(prompt_len)), tenant_weight=weight,
                              sampling=queue_pb2.ResolvedSampling(max_new_tokens=max_new),
                              generated_token_ids=list(range(generated)))
    return Held(f"stream-{priority}", entry_id or f"{request_id}-0", item, read_at)


def take_ids(queue: FairQueue, limit: int, token_budget: int = 10**9) -> list[str]:
    state = {"n": 0, "tokens": 0}

    def admit(held: Held) -> bool:
        if state["n"] >= limit or (state["n"] and state["tokens"] + held.prompt_tokens > token_budget):
            return False
        state["n"] += 1
        state["tokens"] += held.prompt_tokens
        return True

    return [h.item.request_id for h in queue.take(admit)]


def test_round_robin_across_tenants_keeps_each_tenants_order():
    q = FairQueue()
    q.extend(make_held(f"a{i}", "a") for i in range(5))
    q.push(make_held("b0", "b"))
    q.extend(make_held(f"c{i}", "c") for i in range(2))
    assert take_ids(q, 4) == ["a0", "b0", "c0", "a1"]
    assert take_ids(q, 4) == ["c1", "a2", "a3", "a4"]
    assert len(q) == 0


def test_flood_does_not_delay_single_item_beyond_first_batch():
    q = FairQueue()
    q.extend(make_held(f"a{i}", "a") for i in range(1000))
    q.push(make_held("b0", "b"))
    assert "b0" in take_ids(q, 8)


def test_rotation_continues_after_served_tenant():
    q = FairQueue()
    q.extend([make_held("a0", "a"), make_held("a1", "a"), make_held("b0", "b"), make_held("b1", "b")])
    assert take_ids(q, 1) == ["a0"]
    assert take_ids(q, 1) == ["b0"]  # a was served last: b goes first
    assert take_ids(q, 1) == ["a1"]


def test_strict_priority_between_classes():
    q = FairQueue()
    q.extend([make_held("l0", priority=LOW), make_held("n0", priority=NORMAL), make_held("h0", priority=HIGH),
              make_held("u0", priority=inference_pb2.PRIORITY_UNSPECIFIED), make_held("h1", priority=HIGH)])
    assert take_ids(q, 3) == ["h0", "h1", "n0"]
    assert take_ids(q, 3) == ["u0", "l0"]  # unspecified is served as normal


def test_refused_head_skips_tenant_but_not_others():
    q = FairQueue()
    q.extend([make_held("big", "a", prompt_len=90), make_held("a1", "a"), make_held("b0", "b", prompt_len=5),
              make_held("b1", "b", prompt_len=5)])
    # budget 20: the first item always fits; after that only small ones do, a is blocked behind "big"
    assert take_ids(q, 8, token_budget=20) == ["big"]
    assert take_ids(q, 8, token_budget=20) == ["b0", "b1", "a1"]  # a was charged 90 tokens for "big"


def test_duplicate_entries_are_held_once_and_tokens_tracked():
    q = FairQueue()
    assert q.push(make_held("r0", entry_id="1-0", prompt_len=3))
    assert not q.push(make_held("r0", entry_id="1-0", prompt_len=3))
    assert len(q) == 1 and q.prompt_tokens == 3 and ("stream-2", "1-0") in q
    removed = q.remove_if(lambda h: h.item.request_id == "r0")
    assert [h.item.request_id for h in removed] == ["r0"] and len(q) == 0 and q.prompt_tokens == 0


def test_oldest_read_at_across_classes():
    q = FairQueue()
    assert q.oldest_read_at() is None
    q.extend([make_held("x", priority=LOW, read_at=5.0), make_held("y", priority=HIGH, read_at=7.0)])
    assert q.oldest_read_at() == 5.0


def test_peek_is_what_the_next_batch_starts_with():
    q = FairQueue()
    assert q.peek() is None
    q.extend([make_held("n0", "a"), make_held("n1", "b"), make_held("l0", "c", priority=LOW)])
    assert q.peek().request_id == "n0"
    q.push(make_held("h0", "d", priority=HIGH))
    assert q.peek().request_id == "h0"
    assert take_ids(q, 2) == ["h0", "n0"]
    assert q.peek().request_id == "n1"   # tenant a served: b is next in the rotation


# --- token fairness (virtual token counter) -----------------------------------------------------
def first(limit: int) -> Callable[[Held], bool]:
    """An admit callback that takes `limit` items."""
    taken = itertools.count(1)
    return lambda _held: next(taken) <= limit


def tokens_by_tenant(queue: FairQueue, batches: int, limit: int = 8) -> dict[str, int]:
    served: dict[str, int] = {}
    for _ in range(batches):
        for held in queue.take(first(limit)):
            charge = held.prompt_tokens + held.item.sampling.max_new_tokens
            served[held.item.tenant] = served.get(held.item.tenant, 0) + charge
    return served


def test_least_served_tenant_goes_next_counting_tokens():
    q = FairQueue()
    q.extend(make_held(f"a{i}", "a", prompt_len=40) for i in range(3))
    q.extend(make_held(f"b{i}", "b", prompt_len=10) for i in range(6))
    assert take_ids(q, 8) == ["a0", "b0", "b1", "b2", "b3", "a1", "b4", "b5"]


def test_long_and_short_prompts_at_the_same_request_count_get_equal_tokens():
    q = FairQueue()
    # both keep a backlog (the same 1,000 requests each): round-robin would serve them 240 requests
    # each, 30x the tokens to "long"; token-fair serves ~31 short requests per long one
    q.extend(make_held(f"long{i}", "long", prompt_len=2000, max_new=16) for i in range(1000))
    q.extend(make_held(f"short{i}", "short", prompt_len=50, max_new=16) for i in range(1000))
    served = tokens_by_tenant(q, batches=60)
    assert abs(served["long"] - served["short"]) <= 0.1 * served["short"]
    assert served == {"long": 16 * 2016, "short": 464 * 66}


def test_weights_two_to_one_are_honoured():
    q = FairQueue()
    q.extend(make_held(f"a{i}", "a", prompt_len=10, weight=2.0) for i in range(30))
    q.extend(make_held(f"b{i}", "b", prompt_len=10, weight=1.0) for i in range(30))
    assert take_ids(q, 9) == ["a0", "b0", "a1", "b1", "a2", "a3", "b2", "a4", "a5"]
    served = tokens_by_tenant(q, batches=3, limit=9)
    assert served == {"a": 180, "b": 90}


def test_a_lone_tenant_drains_and_an_idle_tenant_banks_no_credit():
    q = FairQueue()
    q.extend(make_held(f"a{i}", "a") for i in range(104))
    assert take_ids(q, 100) == [f"a{i}" for i in range(100)]   # alone: everything, in order
    q.extend(make_held(f"b{i}", "b") for i in range(10))       # new: starts level with a, not 400 behind
    assert take_ids(q, 4) == ["a100", "b0", "a101", "b1"]
    assert take_ids(q, 10) == ["a102", "b2", "a103", "b3", "b4", "b5", "b6", "b7", "b8", "b9"]
    assert len(q) == 0


def test_charge_counts_prior_output_and_the_new_tokens_left():
    held = make_held("r", prompt_len=10, max_new=8, generated=3, weight=2.0)
    assert held.virtual_tokens == (10 + 3 + 5) / 2


def make_targeted(request_id: str, tenant: str, arrival_ms: int, ttft_ms: int, priority: int = NORMAL,
                  tpot_ms: int = 0, generated: int = 0) -> Held:
    held = make_held(request_id, tenant, priority, generated=generated)
    held.item.arrival_unix_ms, held.item.slo_ttft_ms, held.item.slo_tpot_ms = arrival_ms, ttft_ms, tpot_ms
    return held


def test_earliest_deadline_first_within_a_class_across_and_within_tenants():
    q = FairQueue()
    q.push(make_held("plain-a", "a"))
    q.push(make_targeted("late-b", "b", arrival_ms=1_000, ttft_ms=5_000))     # due 6,000
    q.push(make_targeted("soon-a", "a", arrival_ms=2_000, ttft_ms=1_000))     # due 3,000: ahead of plain-a
    q.push(make_targeted("mid-c", "c", arrival_ms=500, ttft_ms=4_000))        # due 4,500
    assert take_ids(q, 4) == ["soon-a", "mid-c", "late-b", "plain-a"]


def test_deadline_counts_tokens_already_generated_at_the_tpot_target():
    q = FairQueue()
    q.push(make_targeted("resumed", "a", arrival_ms=1, ttft_ms=1_000, tpot_ms=100, generated=30))  # due 4,001
    q.push(make_targeted("fresh", "b", arrival_ms=1_000, ttft_ms=2_000))                         # due 3,000
    assert take_ids(q, 2) == ["fresh", "resumed"]


def test_deadlines_do_not_cross_priority_classes():
    q = FairQueue()
    q.push(make_targeted("urgent-low", "a", arrival_ms=1, ttft_ms=1, priority=LOW))
    q.push(make_held("high", "b", priority=HIGH))
    assert take_ids(q, 2) == ["high", "urgent-low"]


def test_untargeted_items_stay_token_fair_and_in_read_order():
    q = FairQueue()
    q.extend([make_held("a0", "a"), make_held("a1", "a"), make_held("b0", "b")])
    assert take_ids(q, 3) == ["a0", "b0", "a1"]


def test_request_round_robin_when_tokens_are_not_counted():
    q = FairQueue(count_tokens=False)
    q.extend(make_held(f"long{i}", "long", prompt_len=2000) for i in range(3))
    q.extend(make_held(f"short{i}", "short", prompt_len=50) for i in range(3))
    assert take_ids(q, 6) == ["long0", "short0", "long1", "short1", "long2", "short2"]
