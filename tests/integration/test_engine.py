"""Engine on a tiny random Llama (CPU, fp32): batching, prefix cache, seeds, preemption, handoff.

Every test runs with plain weights (F.linear), with oneDNN-prepacked fp32 weights (the
production CPU path, CpuBackend.prepare_weights) and with each weight-only quantized format
(`--quantization int8|int4`): the guarantees hold in every configuration a worker can run.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import FINISH_LENGTH, FINISH_STOP, SamplingParams, Sequence
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.ops.cpu.backend import CpuBackend

VOCAB = 128
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def make_model(seed: int = 0) -> LlamaModel:
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, context_length=256, tie_word_embeddings=True)
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture(scope="module", params=["plain", "prepacked", "int8", "int4"])
def model(request) -> LlamaModel:
    model = make_model()
    quantization = "none" if request.param == "prepacked" else request.param
    if request.param != "plain" and not CpuBackend().prepare_weights(model, quantization):
        pytest.skip("this torch build cannot prepack CPU weights")
    return model


def make_engine(model: LlamaModel, num_blocks: int = 64, budget: int = 512, caching: bool = True,
                max_seqs: int = 16) -> LLMEngine:
    return LLMEngine.create(model, EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=max_seqs,
                                                max_num_batched_tokens=budget, enable_prefix_caching=caching))


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (5 + 3 * i,), generator=gen).tolist() for i in range(n)]


def test_batch_of_8_equals_each_alone(model):
    ps = prompts(8)
    alone = [make_engine(model, caching=False).generate([p], [GREEDY])[0] for p in ps]
    # budget 16 forces chunked prefill and mixes prefill chunks with decodes in one forward
    batched = make_engine(model, budget=16, caching=False).generate(ps, [GREEDY] * 8)
    assert batched == alone
    assert all(len(out) == 12 for out in alone)


def test_prefix_cache_hit_gives_identical_output(model):
    shared = prompts(1, seed=5)[0] * 3                      # 15 tokens: 3 full blocks of 4
    a, b = shared + [1, 2, 3], shared + [7, 8]
    miss = make_engine(model, caching=False).generate([b], [GREEDY])[0]
    engine = make_engine(model)
    engine.generate([a], [GREEDY])
    seq = Sequence(b, GREEDY)
    engine.add(seq)
    while engine.has_work():
        engine.step()
    assert seq.num_cached_prompt_tokens == 12
    assert seq.output_token_ids == miss
    assert engine.block_manager.stats.hit_tokens == 12


def test_same_seed_same_text_across_batch_compositions(model):
    sampled = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=2024, max_new_tokens=16)
    target = prompts(1, seed=9)[0]
    alone = make_engine(model).generate([target], [sampled])[0]
    others = prompts(5, seed=11)
    mixed = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=10 + i) for i in range(5)]
    together = make_engine(model, budget=8).generate([*others[:2], target, *others[2:]],
                                                     [*mixed[:2], sampled, *mixed[2:]])
    assert together[2] == alone
    other_seed = make_engine(model).generate([target], [SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                                       seed=7, max_new_tokens=16)])[0]
    assert other_seed != alone


def test_preemption_resumes_with_same_output(model):
    ps = prompts(6, seed=3)
    sampled = [SamplingParams(temperature=0.8, seed=100 + i, max_new_tokens=20) for i in range(6)]
    roomy = make_engine(model).generate(ps, sampled)
    tight = make_engine(model, num_blocks=14)
    assert tight.generate(ps, sampled) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 14


def test_handoff_continuation_equals_undisturbed_run(model):
    sampled = SamplingParams(temperature=1.0, seed=77, max_new_tokens=15)
    prompt = prompts(1, seed=21)[0]
    full = make_engine(model).generate([prompt], [sampled])[0]
    engine = make_engine(model)
    seq = Sequence(prompt, sampled, prior_output_ids=full[:6])  # another worker made the first 6
    engine.add(seq)
    while engine.has_work():
        engine.step()
    assert seq.index_offset == 6
    assert full[:6] + seq.output_token_ids == full


def test_stop_token_and_length_limits(model):
    prompt = prompts(1, seed=4)[0]
    free_run = make_engine(model).generate([prompt], [GREEDY])[0]
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    engine = make_engine(model)
    seq = Sequence(prompt, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_at,)))
    engine.add(seq)
    while engine.has_work():
        engine.step()
    assert seq.output_token_ids == free_run[:first]
    assert seq.finish_reason == FINISH_STOP
    long_seq = Sequence([i % VOCAB for i in range(250)], SamplingParams(temperature=0.0, max_new_tokens=100))
    engine.add(long_seq)
    while engine.has_work():
        engine.step()
    assert long_seq.finish_reason == FINISH_LENGTH and long_seq.num_tokens == 256


def test_abort_frees_blocks_and_others_continue(model):
    engine = make_engine(model)
    ps = prompts(3, seed=8)
    seqs = [Sequence(p, GREEDY) for p in ps]
    for s in seqs:
        engine.add(s)
    engine.step()
    engine.abort(seqs[1], reason=3)
    while engine.has_work():
        engine.step()
    assert len(seqs[1].output_token_ids) == 1
    assert [len(s.output_token_ids) for s in (seqs[0], seqs[2])] == [12, 12]
    assert engine.block_manager.num_free_blocks == 64
