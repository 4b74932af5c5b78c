"""n choices of one work item in the worker: separate sequences, seeds seed + i, one prefill.

The followers (choices 1..n-1) are scheduled only after choice 0 computed the prompt, so they
find its full blocks in the prefix cache; only the last, partial block is computed again.
"""

from __future__ import annotations

import torch

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import Sequence
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.requests import Tracked, handoff_items
from llmserve.v1 import queue_pb2

VOCAB, BLOCK = 128, 4
PROMPT = [(7 * i + 3) % VOCAB for i in range(18)]      # 18 tokens: 4 full blocks and 2 more


def make_model() -> LlamaModel:
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, context_length=256, tie_word_embeddings=True)
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.2)
    return model


MODEL = make_model()


def make_item(n: int, seed: int = 42) -> queue_pb2.WorkItem:
    return queue_pb2.WorkItem(request_id="r1", tenant="acme", prompt_token_ids=PROMPT, n=n,
                              sampling=queue_pb2.ResolvedSampling(temperature=1.0, top_p=1.0, max_new_tokens=8,
                                                                  seed=seed))


def run(item: queue_pb2.WorkItem) -> tuple[list[Sequence], LLMEngine]:
    engine = LLMEngine.create(MODEL, EngineConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64))
    seqs = [t.seq for t in Tracked.choices_of(item, "1-0")]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return seqs, engine


def test_choices_are_separate_sequences_with_seeds_seed_plus_index():
    seqs, _ = run(make_item(3))
    assert [s.choice_index for s in seqs] == [0, 1, 2]
    assert [s.params.seed for s in seqs] == [42, 43, 44]
    outputs = [s.output_token_ids for s in seqs]
    assert len({tuple(o) for o in outputs}) == 3                      # the choices differ
    again, _ = run(make_item(3))
    assert [s.output_token_ids for s in again] == outputs              # and each reproduces


def test_followers_reuse_the_leaders_prompt_blocks():
    seqs, engine = run(make_item(4))
    full_blocks = (len(PROMPT) - 1) // BLOCK * BLOCK                  # one token always left to compute
    assert seqs[0].num_cached_prompt_tokens == 0
    assert [s.num_cached_prompt_tokens for s in seqs[1:]] == [full_blocks] * 3
    assert engine.stats().prefix_hit_rate > 0


def test_unfinished_choices_are_handed_back_together_and_continue():
    seqs, _ = run(make_item(3))
    choices = Tracked.choices_of(make_item(3), "1-0")
    for tracked, done in zip(choices, seqs):
        for token in done.output_token_ids[:3]:
            tracked.seq.append_token(token)
    items = handoff_items([choices[0], choices[2]])                     # choice 1 had finished
    assert len(items) == 1                                              # one item: one dispatch, one fence
    item = queue_pb2.WorkItem.FromString(items[0].SerializeToString())
    assert [(c.index, list(c.generated_token_ids)) for c in item.choices] == \
        [(0, seqs[0].output_token_ids[:3]), (2, seqs[2].output_token_ids[:3])]
    resumed, _ = run(item)
    assert [s.choice_index for s in resumed] == [0, 2]
    for seq, done in zip(resumed, (seqs[0], seqs[2])):
        assert [*seq.prior_output_ids, *seq.output_token_ids] == done.output_token_ids


def test_a_single_choice_hands_back_its_tokens_as_before():
    tracked = Tracked.from_item(make_item(1), "1-0")
    tracked.seq.append_token(9)
    item = handoff_items([tracked])[0]
    assert list(item.generated_token_ids) == [9] and not item.choices
