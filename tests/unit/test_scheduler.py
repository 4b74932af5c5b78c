"""Scheduler: decode-first batching, chunked prefill under a token budget, preemption, finish."""

from __future__ import annotations

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from gpu_worker.engine.sequence import SamplingParams, Sequence, SequenceStatus

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
