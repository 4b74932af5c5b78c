"""Grammar masks in the sampler and engine, on a tiny random Llama with SmolLM2's vocabulary:
masks per row in mixed batches, EOS only where the grammar accepts, seeds that reproduce
across batch compositions, and matcher state that survives preemption and handoff."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gpu_worker.engine.constraint import Constraints
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sampler import Sampler
from gpu_worker.engine.sequence import FINISH_STOP, Failure, SamplingParams, Sequence
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from llmserve.protocol.grammar import grammar_of
from llmserve.v1 import inference_pb2 as pb
from tokenizer_svc.loader import load_tokenizer

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "n"], "additionalProperties": False}
REGEX = r"[0-9]{2,4}"


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def constraints(vocab) -> Constraints:
    return Constraints.from_tokenizer_json(vocab.to_json(), vocab.eos_token_ids, vocab.vocab_size)


@pytest.fixture(scope="module")
def model(vocab) -> LlamaModel:
    config = ModelConfig(vocab_size=vocab.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, context_length=256, tie_word_embeddings=True)
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.5)
    return model


def grammar(**kind) -> str:
    return grammar_of(pb.ResponseFormat(**kind))


def params(vocab, g: str = "", **kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 40)
    return SamplingParams(stop_token_ids=tuple(vocab.eos_token_ids), grammar=g, **kw)


def make_engine(model, constraints, num_blocks: int = 128) -> LLMEngine:
    return LLMEngine.create(model, EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=16),
                            constraints=constraints)


def run(engine: LLMEngine, seqs: list[Sequence]) -> list[list[int]]:
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return [seq.output_token_ids for seq in seqs]


def started(constraints, seq: Sequence) -> Sequence:
    constraints.start(seq)
    return seq


def test_masks_apply_to_constrained_rows_only(vocab, constraints):
    choice = started(constraints, Sequence([1], params(vocab, grammar(choice=pb.ChoiceList(choices=["yes", "no"])))))
    free = Sequence([1], params(vocab))
    logits = torch.randn(2, vocab.vocab_size, generator=torch.Generator().manual_seed(1))
    masked = constraints.apply_masks(logits, [choice, free])
    assert torch.equal(masked[1], logits[1])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed and all("yes".startswith(vocab.decode([t])) or "no".startswith(vocab.decode([t]))
                           for t in allowed)


def test_eos_only_where_the_grammar_accepts(vocab, constraints):
    seq = started(constraints, Sequence([1], params(vocab, grammar(regex=REGEX))))
    eos = vocab.eos_token_ids[0]
    digit = vocab.encode("7")
    assert len(digit) == 1
    for produced in range(5):
        allowed = torch.isfinite(constraints.apply_masks(torch.zeros(1, vocab.vocab_size), [seq])[0])
        assert bool(allowed[eos]) == (2 <= produced <= 4)
        assert bool(allowed[digit[0]]) == (produced < 4)
        if produced < 4:
            seq.append_token(digit[0])
            assert constraints.advance(seq, digit[0])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_outputs_match_in_a_mixed_batch(vocab, constraints, model, temperature):
    kinds = {"schema": grammar(json_schema=json.dumps(SCHEMA)), "regex": grammar(regex=REGEX),
             "choice": grammar(choice=pb.ChoiceList(choices=["alpha", "beta", "gamma"])), "free": ""}
    seqs = [Sequence([5 + i, 9, 11], params(vocab, g, temperature=temperature, seed=i))
            for i, g in enumerate(kinds.values())]
    outs = dict(zip(kinds, run(make_engine(model, constraints), seqs)))
    assert all(seq.finish_reason == FINISH_STOP for seq in seqs[:3])
    document = json.loads(vocab.decode(outs["schema"]))
    assert document["kind"] in ("cat", "dog") and 0 <= document["n"] <= 9 and set(document) == {"kind", "n"}
    assert re.fullmatch(REGEX, vocab.decode(outs["regex"]))
    assert vocab.decode(outs["choice"]) in ("alpha", "beta", "gamma")


def test_seeded_constrained_request_same_alone_and_batched(vocab, constraints, model):
    g = grammar(json_schema=json.dumps(SCHEMA))
    target = params(vocab, g, temperature=1.0, seed=42)
    alone = run(make_engine(model, constraints), [Sequence([3, 4, 5], target)])[0]
    others = [Sequence([7 + i] * (2 + i), params(vocab, g if i % 2 else "", temperature=0.7, seed=i))
              for i in range(5)]
    batched = run(make_engine(model, constraints), [*others[:2], Sequence([3, 4, 5], target), *others[2:]])
    assert batched[2] == alone


def test_preemption_keeps_the_matcher(vocab, constraints, model):
    gs = [grammar(json_schema=json.dumps(SCHEMA)), grammar(regex=REGEX)] * 3
    def make():
        return [Sequence([2 + i] * (6 + i), params(vocab, g, temperature=1.0, seed=10 + i)) for i, g in enumerate(gs)]
    roomy = run(make_engine(model, constraints), make())
    tight = make_engine(model, constraints, num_blocks=16)
    assert run(tight, make()) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_handoff_rebuilds_the_matcher_from_produced_tokens(vocab, constraints, model):
    sp = params(vocab, grammar(json_schema=json.dumps(SCHEMA)), temperature=1.0, seed=5)
    full = run(make_engine(model, constraints), [Sequence([8, 9], sp)])[0]
    assert len(full) > 6
    resumed = Sequence([8, 9], sp, prior_output_ids=full[:6])     # another worker made the first 6
    run(make_engine(model, constraints), [resumed])
    assert full[:6] + resumed.output_token_ids == full
    assert json.loads(vocab.decode(full))


def test_prior_tokens_the_grammar_rejects_fail_that_sequence_only(vocab, constraints, model):
    engine = make_engine(model, constraints)
    bad = Sequence([1, 2], params(vocab, grammar(regex=REGEX)), prior_output_ids=vocab.encode("abc"))
    good = Sequence([1, 2], params(vocab, grammar(regex=REGEX)))
    done = engine.add(bad)
    assert done is not None and bad.failure is Failure.BAD_CONSTRAINT
    run(engine, [good])
    assert re.fullmatch(REGEX, vocab.decode(good.output_token_ids))


def test_sampler_without_constraints_ignores_grammars(vocab):
    seq = Sequence([1], params(vocab, temperature=0.0))
    logits = torch.randn(1, vocab.vocab_size, generator=torch.Generator().manual_seed(3))
    assert Sampler()(logits, [seq]) == [int(logits.argmax())]
