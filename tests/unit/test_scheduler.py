"""Scheduler: decode-first batching, chunked prefill under a token budget, preemption, finish."""

from __future__ import annotations

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from gpu_worker.engine.sequence import SamplingParams, Sequence, SequenceStatus
from llmserve.protocol.slo import Targets
from llmserve.v1 import inference_pb2

BS = 4


def make_seq(n: int, start: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(temperature=0.0))


def make_scheduler(num_blocks: int = 16, max_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget), BlockManager(num_blocks, BS))


def run_step(sched: Scheduler, out: SchedulerOutput, sampled: int = 1000) -> None:
    """What the engine does after a forward: advance computed counts, append a token when done."""
    for item in out.scheduled:
        done = item.completes_context
        item.seq.num_computed_tokens += item.num_tokens
        sched.blocks.cache_computed_blocks(item.seq)
        if done:
            item.seq.append_token(sampled)


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_tokens) for s in out.scheduled]


def test_admits_in_order_then_decodes_one_token_each():
    sched = make_scheduler()
    a, b = make_seq(5), make_seq(3, 100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 5), (b.seq_id, 3)]
    run_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    assert sched.blocks.block_table(a) == [0, 1] and sched.blocks.block_table(b) == [2]


def test_chunked_prefill_under_token_budget_keeps_decodes_first():
    sched = make_scheduler(budget=8)
    a = make_seq(3)
    sched.add(a)
    run_step(sched, sched.schedule())
    long = make_seq(20, 100)
    sched.add(long)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 1), (long.seq_id, 7)]
    run_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 1), (long.seq_id, 7)]
    assert not out.scheduled[1].completes_context
    run_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 1), (long.seq_id, 6)]
    assert out.scheduled[1].completes_context


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_seqs=2)
    seqs = [make_seq(2, 10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert list(sched.waiting) == [seqs[2]]


def test_preempts_newest_when_blocks_run_out_and_resumes_it():
    sched = make_scheduler(num_blocks=4)
    a, b = make_seq(8), make_seq(8, 100)        # two blocks each: the cache is full
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())           # both sampled a 9th token → each needs a 3rd block
    out = sched.schedule()
    assert out.preempted == [b]
    assert plan(out) == [(a.seq_id, 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b]
    assert sched.num_preemptions == 1
    sched.finish(a)
    out = sched.schedule()                      # b comes back: 9 tokens, first block from the prefix cache
    assert plan(out) == [(b.seq_id, 5)]
    assert b.num_computed_tokens == 4


def test_finish_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=4)
    a = make_seq(8)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.schedule()                            # the 9th token gets its block
    assert sched.blocks.num_free_blocks == 1
    sched.finish(a)
    assert sched.blocks.num_free_blocks == 4
    assert not sched.has_work()


def test_sequence_larger_than_cache_is_reported_not_stuck():
    sched = make_scheduler(num_blocks=2)
    big, small = make_seq(9), make_seq(3, 50)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.out_of_memory == [big]
    assert plan(out) == [(small.seq_id, 3)]


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=5)
    a, b = make_seq(8), make_seq(8, 100)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())           # 4 blocks used, 1 free
    c = make_seq(2, 200)
    sched.add(c)
    out = sched.schedule()                      # a takes the free block, b must go
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert list(sched.waiting) == [b, c]


# --- priority preemption and aging ------------------------------------------------------------
LOW, NORMAL, HIGH = inference_pb2.PRIORITY_LOW, inference_pb2.PRIORITY_NORMAL, inference_pb2.PRIORITY_HIGH


def make_prio(n: int, start: int, priority: int) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(temperature=0.0), priority=priority)


def make_prio_scheduler(num_blocks: int = 16, max_seqs: int = 8, aging_steps: int = 256,
                        preemption: bool = True) -> Scheduler:
    config = SchedulerConfig(max_seqs, 64, priority_preemption=preemption, aging_steps=aging_steps)
    return Scheduler(config, BlockManager(num_blocks, BS))


def test_high_takes_the_slot_of_the_lowest_newest_running_sequence_at_once():
    sched = make_prio_scheduler(max_seqs=3)
    low1, normal, low2 = make_prio(3, 0, LOW), make_prio(3, 10, NORMAL), make_prio(3, 20, LOW)
    for s in (low1, normal, low2):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [normal, low1, low2]     # admitted in rank order
    run_step(sched, out)
    high = make_prio(5, 30, HIGH)
    sched.add(high)
    out = sched.schedule()
    assert out.preempted == [low2]
    assert plan(out) == [(high.seq_id, 5), (normal.seq_id, 1), (low1.seq_id, 1)]
    assert list(sched.waiting) == [low2]
    assert low2.output_token_ids == [1000] and low2.num_computed_tokens == 0   # output kept, KV recomputed


def test_high_preempts_as_few_as_free_its_blocks():
    sched = make_prio_scheduler(num_blocks=6)
    lows = [make_prio(7, 10 * i, LOW) for i in range(3)]       # two blocks each: the cache is full
    for s in lows:
        sched.add(s)
    run_step(sched, sched.schedule())
    high = make_prio(7, 100, HIGH)
    sched.add(high)
    out = sched.schedule()
    assert out.preempted == [lows[2]]
    assert plan(out) == [(high.seq_id, 7), (lows[0].seq_id, 1), (lows[1].seq_id, 1)]


def test_no_preemption_of_equal_or_higher_rank_or_when_it_cannot_fit():
    sched = make_prio_scheduler(num_blocks=6)
    early, low = make_prio(7, 0, HIGH), make_prio(7, 10, LOW)
    sched.add(early)
    sched.add(low)
    run_step(sched, sched.schedule())
    late = make_prio(12, 100, HIGH)         # 3 blocks: only 2 free, and preempting low frees 2 more
    sched.add(late)
    out = sched.schedule()
    assert out.preempted == [low] and plan(out)[0] == (late.seq_id, 12)
    huge = make_prio(30, 200, HIGH)         # 8 blocks: more than the whole cache, nobody is evicted
    sched.add(huge)
    out = sched.schedule()
    assert out.preempted == []
    assert [s.seq for s in out.scheduled] == [early, late]


def test_disabled_priority_preemption_leaves_high_waiting():
    sched = make_prio_scheduler(max_seqs=1, preemption=False)
    low, high = make_prio(3, 0, LOW), make_prio(3, 10, HIGH)
    sched.add(low)
    run_step(sched, sched.schedule())
    sched.add(high)
    out = sched.schedule()
    assert out.preempted == [] and plan(out) == [(low.seq_id, 1)]
    assert list(sched.waiting) == [high]


def test_waiting_queue_is_in_priority_order_then_age():
    sched = make_prio_scheduler(max_seqs=1)
    low, normal_a, high, normal_b = (make_prio(2, 0, LOW), make_prio(2, 10, NORMAL), make_prio(2, 20, HIGH),
                                     make_prio(2, 30, inference_pb2.PRIORITY_UNSPECIFIED))
    for s in (low, normal_a, high, normal_b):
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [(high.seq_id, 2)]
    assert list(sched.waiting) == [normal_a, normal_b, low]


def test_kv_pressure_preempts_the_lowest_level_not_the_newest():
    sched = make_prio_scheduler(num_blocks=4)
    low = make_prio(7, 0, LOW)
    sched.add(low)
    run_step(sched, sched.schedule())           # low: 8 tokens in 2 blocks
    high = make_prio(7, 100, HIGH)
    sched.add(high)
    run_step(sched, sched.schedule())           # high takes the other 2 blocks; low now needs a third
    out = sched.schedule()
    assert out.preempted == [low]
    assert plan(out) == [(high.seq_id, 1)]


def test_aging_bounds_a_low_sequences_wait_under_a_high_flood():
    aging = 3
    sched = make_prio_scheduler(max_seqs=1, aging_steps=aging)
    low = make_prio(2, 0, LOW)
    sched.add(low)
    steps_waited = 0
    for step in range(40):
        sched.add(make_prio(2, 100 + step, HIGH))   # a fresh HIGH arrives every step
        out = sched.schedule()
        if low in [s.seq for s in out.scheduled]:
            break
        steps_waited += 1
        run_step(sched, out)
        for seq in list(sched.running):             # each HIGH is done after one token
            if seq.output_token_ids:
                sched.finish(seq)
    assert steps_waited == low.waited_steps == 2 * aging  # LOW gains a level every `aging` steps
    assert sched.level(low) == HIGH
    for step in range(3):                        # once aged it outranks every later HIGH: it keeps running
        run_step(sched, out)
        sched.add(make_prio(2, 200 + step, HIGH))
        out = sched.schedule()
        assert out.preempted == [] and [s.seq for s in out.scheduled] == [low]


# --- deadlines (SLO targets) -------------------------------------------------------------------
def make_slo(n: int, start: int, priority: int, arrival_ms: int, ttft_ms: int, tpot_ms: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(temperature=0.0), priority=priority,
                    slo=Targets(ttft_ms, tpot_ms), arrival_unix_ms=arrival_ms)


def test_waiting_queue_is_earliest_deadline_first_within_a_priority():
    sched = make_prio_scheduler(max_seqs=1)
    plain = make_prio(2, 0, NORMAL)
    late = make_slo(2, 10, NORMAL, arrival_ms=1_000, ttft_ms=9_000)    # due 10,000
    soon = make_slo(2, 20, NORMAL, arrival_ms=5_000, ttft_ms=1_000)    # due 6,000
    low_urgent = make_slo(2, 30, LOW, arrival_ms=1, ttft_ms=1)          # due first, but LOW
    for s in (plain, late, soon, low_urgent):
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [(soon.seq_id, 2)]
    assert list(sched.waiting) == [late, plain, low_urgent]


def test_a_deadline_never_preempts_within_its_priority():
    sched = make_prio_scheduler(max_seqs=1)
    running = make_prio(2, 0, NORMAL)
    sched.add(running)
    run_step(sched, sched.schedule())
    urgent = make_slo(2, 10, NORMAL, arrival_ms=1, ttft_ms=1)
    sched.add(urgent)
    out = sched.schedule()
    assert out.preempted == [] and plan(out) == [(running.seq_id, 1)]


def test_aging_bound_holds_against_a_flood_of_high_deadlines():
    aging = 3
    sched = make_prio_scheduler(max_seqs=1, aging_steps=aging)
    low = make_prio(2, 0, LOW)
    sched.add(low)
    steps_waited = 0
    for step in range(40):
        sched.add(make_slo(2, 100 + step, HIGH, arrival_ms=1, ttft_ms=1))   # always due before anyone
        out = sched.schedule()
        if low in [s.seq for s in out.scheduled]:
            break
        steps_waited += 1
        run_step(sched, out)
        for seq in list(sched.running):
            if seq.output_token_ids:
                sched.finish(seq)
    assert steps_waited == 2 * aging


def test_preemptible_by_high_counts_running_below_high_and_their_blocks():
    sched = make_prio_scheduler()
    for seq in (make_prio(7, 0, LOW), make_prio(3, 10, NORMAL), make_prio(3, 20, HIGH)):
        sched.add(seq)
    run_step(sched, sched.schedule())
    assert sched.preemptible_by_high() == (2, 3)      # LOW holds 2 blocks, NORMAL 1; HIGH is not preemptible
    assert make_prio_scheduler(preemption=False).preemptible_by_high() == (0, 0)


def test_admission_is_token_fair_across_tenants():
    sched = make_prio_scheduler(max_seqs=2)
    heavy = Sequence(list(range(40)), SamplingParams(temperature=0.0), tenant="heavy")
    light = Sequence(list(range(100, 103)), SamplingParams(temperature=0.0), tenant="light")
    sched.add(heavy)
    sched.add(light)
    run_step(sched, sched.schedule())                 # heavy computed 40 tokens, light 3
    late_heavy = Sequence(list(range(200, 203)), SamplingParams(temperature=0.0), tenant="heavy")
    light2 = Sequence(list(range(300, 303)), SamplingParams(temperature=0.0), tenant="light")
    sched.add(late_heavy)                             # older than light2, but its tenant was served more
    sched.add(light2)
    sched.finish(heavy)
    assert plan(sched.schedule()) == [(light.seq_id, 1), (light2.seq_id, 3)]
    assert sched.served == {"heavy": 40.0, "light": 7.0}
    assert list(sched.waiting) == [late_heavy]


def test_a_tenant_that_rejoins_starts_at_the_least_active_counter():
    sched = make_prio_scheduler(max_seqs=1)
    busy = Sequence(list(range(40)), SamplingParams(temperature=0.0), tenant="busy")
    sched.add(busy)
    run_step(sched, sched.schedule())
    sched.add(Sequence(list(range(3)), SamplingParams(temperature=0.0), tenant="idle"))
    assert sched.served["idle"] == 40.0               # no credit banked while it sent nothing


def test_tenant_weight_divides_the_tokens_charged():
    sched = make_prio_scheduler()
    seq = Sequence(list(range(8)), SamplingParams(temperature=0.0), tenant="gold", tenant_weight=4.0)
    sched.add(seq)
    run_step(sched, sched.schedule())
    assert sched.served["gold"] == 2.0


def test_request_round_robin_charges_one_per_admission():
    sched = Scheduler(SchedulerConfig(8, 64, fair_tokens=False), BlockManager(16, BS))
    seq = Sequence(list(range(40)), SamplingParams(temperature=0.0), tenant="t")
    sched.add(seq)
    run_step(sched, sched.schedule())
    run_step(sched, sched.schedule())                 # a decode step admits nobody: no charge
    assert sched.served["t"] == 1.0


def test_drafts_take_only_the_budget_and_blocks_the_plan_left():
    sched = make_scheduler(num_blocks=4)
    a, b = make_seq(4), make_seq(4, 100)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())                 # 5 tokens each, 4 computed: a block each, 2 free
    out = sched.schedule()                            # each decode takes its second block: none free
    sched.add_drafts(out, [(a, [1, 2, 3, 4])])        # would need a third block for a
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 1)] and a.draft_token_ids == []
    assert sched.num_preemptions == 0 and sched.blocks.num_free_blocks == 0

    sched = make_scheduler(num_blocks=16, budget=5)
    a, b = make_seq(2), make_seq(2, 100)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())                 # 3 tokens each, 2 computed
    out = sched.schedule()
    sched.add_drafts(out, [(a, [1, 2, 3, 4]), (b, [7])])  # 3 tokens of budget left: a's draft is cut
    assert plan(out) == [(a.seq_id, 4), (b.seq_id, 1)] and a.draft_token_ids == [1, 2, 3]
    assert out.scheduled[0].num_logits == 4 and out.scheduled[1].num_logits == 1
    assert a.tokens_in(2, 6) == [a.token_ids[2], 1, 2, 3]
    assert len(sched.blocks.block_table(a)) == 2      # position 5 opens a second block
