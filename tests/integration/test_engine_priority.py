"""Priority preemption in the engine on tiny random Llamas (CPU, fp32): a HIGH arrival takes a
full engine's slot within one step, and the LOW sequence it evicted finishes with exactly the
tokens of its undisturbed seeded run, free text or grammar-constrained."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.engine.constraint import Constraints
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from llmserve.protocol.grammar import grammar_of
from llmserve.v1 import inference_pb2 as pb
from tokenizer_svc.loader import load_tokenizer

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "n"], "additionalProperties": False}


def make_model(vocab_size: int) -> LlamaModel:
    config = ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, context_length=256, tie_word_embeddings=True)
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.5)
    return model


def make_engine(model: LlamaModel, max_seqs: int, constraints: Constraints | None = None) -> LLMEngine:
    return LLMEngine.create(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=max_seqs),
                            constraints=constraints)


def run_alone(model: LlamaModel, seq: Sequence, constraints: Constraints | None = None) -> list[int]:
    engine = make_engine(model, 4, constraints)
    engine.add(seq)
    while engine.has_work():
        engine.step()
    return seq.output_token_ids


def preempt_by_high(engine: LLMEngine, lows: list[Sequence], high: Sequence) -> None:
    """Fill the engine with `lows`, let them decode, then add `high`: it must run in the next step."""
    for seq in lows:
        engine.add(seq)
    for _ in range(4):
        engine.step()
    engine.add(high)
    engine.step()
    assert high in engine.running and lows[-1] in engine.waiting
    assert engine.scheduler.num_preemptions == 1
    while engine.has_work():
        engine.step()


def copy(seq: Sequence) -> Sequence:
    return Sequence(list(seq.prompt_token_ids), seq.params, priority=seq.priority)


def test_preempted_seeded_sequence_equals_its_undisturbed_run():
    model = make_model(128)
    lows = [Sequence([3 + i] * (5 + i), SamplingParams(temperature=0.9, seed=40 + i, max_new_tokens=16),
                     priority=pb.PRIORITY_LOW) for i in range(2)]
    high = Sequence([9, 8, 7], SamplingParams(temperature=0.9, seed=7, max_new_tokens=6), priority=pb.PRIORITY_HIGH)
    alone = [run_alone(model, copy(s)) for s in (*lows, high)]
    preempt_by_high(make_engine(model, max_seqs=2), lows, high)
    assert [s.output_token_ids for s in (*lows, high)] == alone
    assert all(len(out) == n for out, n in zip(alone, (16, 16, 6)))


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    return load_tokenizer(smollm2_path)


def test_structured_output_survives_preemption_by_priority(vocab):
    constraints = Constraints.from_tokenizer_json(vocab.to_json(), vocab.eos_token_ids, vocab.vocab_size)
    model = make_model(vocab.vocab_size)
    schema = grammar_of(pb.ResponseFormat(json_schema=json.dumps(SCHEMA)))
    sp = SamplingParams(temperature=1.0, seed=11, max_new_tokens=40, stop_token_ids=tuple(vocab.eos_token_ids),
                        grammar=schema)
    low = Sequence([2] * 6, sp, priority=pb.PRIORITY_LOW)
    high = Sequence([5] * 4, SamplingParams(temperature=1.0, seed=3, max_new_tokens=8), priority=pb.PRIORITY_HIGH)
    alone = run_alone(model, copy(low), constraints)
    preempt_by_high(make_engine(model, max_seqs=1, constraints=constraints), [low], high)
    assert low.output_token_ids == alone
    assert json.loads(vocab.decode(low.output_token_ids))["kind"] in ("cat", "dog")
