"""Prompt-lookup speculation (gpu_worker/engine/speculation.py) on the engine over a tiny random
Llama, in every weight format a CPU worker runs: output is the same token for token with drafts on
or off (greedy, seeded sampling, penalties, logprobs, stop tokens, limits, batches, preemption),
and drafts are both kept and refused along the way, so both paths of the verification ran.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import VOCAB, make_model, prompts

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.engine.speculation import SpeculationConfig
from gpu_worker.ops.cpu.backend import CpuBackend

OFF = SpeculationConfig()
DRAFTS = SpeculationConfig(num_tokens=4, max_running=4)


@pytest.fixture(scope="module", params=["plain", "prepacked", "int8", "int4"])
def model(request):
    model = make_model()
    quantization = "none" if request.param == "prepacked" else request.param
    if request.param != "plain" and not CpuBackend().prepare_weights(model, quantization):
        pytest.skip("this torch build cannot prepack CPU weights")
    return model


def make_engine(model, speculation: SpeculationConfig = OFF, num_blocks: int = 64,
                budget: int = 512) -> LLMEngine:
    return LLMEngine.create(model, EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=16,
                                                max_num_batched_tokens=budget, speculation=speculation))


def repetitive(n: int) -> list[list[int]]:
    """Prompts whose text repeats, so the context has n-grams to look up from the first step."""
    return [(p[:4] * 4) + p[4:] for p in prompts(n, seed=31)]


def run(engine: LLMEngine, ps: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
    return engine.run([Sequence(list(p), sp) for p, sp in zip(ps, params)])


def test_greedy_output_is_the_same_and_drafts_are_kept_and_refused(model):
    ps = repetitive(6) + prompts(2, seed=32)
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=24)] * len(ps)
    plain = make_engine(model).generate(ps, greedy)
    drafted = [make_engine(model, DRAFTS).generate([p], [g])[0] for p, g in zip(ps, greedy)]
    assert drafted == plain
    engine = make_engine(model, DRAFTS)
    for p, g in zip(ps, greedy):
        engine.generate([p], [g])
    counters = engine.counters
    assert 0 < counters.accepted_draft_tokens < counters.draft_tokens
    assert counters.steps < counters.generated_tokens + len(ps)   # fewer steps than one a token
    assert engine.block_manager.num_free_blocks == 64


def test_sampled_output_is_the_same_with_penalties_and_logprobs(model, request):
    ps = repetitive(4)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=5, max_new_tokens=20),
              SamplingParams(temperature=1.0, seed=6, max_new_tokens=20, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.5, seed=7, repetition_penalty=1.3, max_new_tokens=20),
              SamplingParams(temperature=0.0, max_new_tokens=20, logprobs=True, top_logprobs=2)]
    plain = [run(make_engine(model), [p], [sp])[0] for p, sp in zip(ps, params)]
    drafted = [run(make_engine(model, DRAFTS), [p], [sp])[0] for p, sp in zip(ps, params)]
    assert [s.output_token_ids for s in drafted] == [s.output_token_ids for s in plain]
    if request.node.callspec.params["model"] != "plain":      # the worker's kernels: a row's bits are its own
        assert [s.output_logprobs for s in drafted] == [s.output_logprobs for s in plain]
        return
    # F.linear's fp32 rows may round differently in a 5-row GEMM than in a 1-row one
    for ours, theirs in zip(drafted, plain):
        assert len(ours.output_logprobs) == len(theirs.output_logprobs)
        for x, y in zip(ours.output_logprobs, theirs.output_logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_stop_token_and_length_limit_inside_a_draft(model):
    prompt = repetitive(1)[0]
    free_run = make_engine(model).generate([prompt], [SamplingParams(temperature=0.0, max_new_tokens=30)])[0]
    stop_at = free_run[5]
    stopped = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=(stop_at,))
    assert make_engine(model, DRAFTS).generate([prompt], [stopped])[0] == free_run[:free_run.index(stop_at)]
    for limit in (1, 2, 3, 7):
        short = SamplingParams(temperature=0.0, max_new_tokens=limit)
        assert make_engine(model, DRAFTS).generate([prompt], [short])[0] == free_run[:limit]
    near_end = [i % VOCAB for i in range(250)]               # the context (256) ends mid-draft
    long_params = SamplingParams(temperature=0.0, max_new_tokens=100)
    assert make_engine(model, DRAFTS).generate([near_end], [long_params]) == \
        make_engine(model).generate([near_end], [long_params])


def test_batches_small_budgets_and_preemption_keep_the_output(model):
    ps = repetitive(3) + prompts(3, seed=33)
    sampled = [SamplingParams(temperature=0.8, seed=100 + i, max_new_tokens=20) for i in range(len(ps))]
    plain = make_engine(model).generate(ps, sampled)
    # 6 running > max_running 4 at first: drafting starts once sequences finish
    assert make_engine(model, DRAFTS).generate(ps, sampled) == plain
    # a budget of 3 tokens cuts drafts short; 14 blocks preempt
    assert make_engine(model, DRAFTS, budget=8).generate(ps[:3], sampled[:3]) == plain[:3]
    tight = make_engine(model, DRAFTS, num_blocks=14)
    assert tight.generate(ps, sampled) == plain
    assert tight.block_manager.num_free_blocks == 14


def test_drafting_stops_above_max_running(model):
    ps = repetitive(3)
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=12)] * 3
    engine = make_engine(model, SpeculationConfig(num_tokens=4, max_running=2))
    seqs = [Sequence(list(p), g) for p, g in zip(ps, greedy)]
    for seq in seqs:
        engine.add(seq)
    engine.step()                                             # the prompts
    engine.step()                                             # three decode: no drafts
    assert engine.counters.draft_tokens == 0
    assert [len(s.output_token_ids) for s in seqs] == [2, 2, 2]


def test_prompt_lookup_does_not_change_a_step_without_repeats():
    engine = make_engine(make_model(), DRAFTS)
    gen = torch.Generator().manual_seed(3)
    distinct = torch.randperm(VOCAB, generator=gen)[:20].tolist()  # no n-gram repeats in the prompt
    seq = Sequence(distinct, SamplingParams(temperature=0.0, max_new_tokens=1))
    engine.add(seq)
    engine.step()
    assert engine.counters.draft_tokens == 0
