"""Logprobs of the engine's own steps (paged KV, chunked prefill, batching) against an offline oracle:
transformers' model over the same tiny random checkpoint, one causal forward of prompt + completion.

Tolerance: fp32 on both sides, and test_architectures.py holds the logits within 1e-4 * max |logit|
of the row; a log-softmax moves by at most twice the largest logit error, so 2e-3 absolute here
(max |logit| of these rows is a few units) is that bound with room, and far below the gaps between
the alternatives it must rank.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_hf_dir, transformers_logits

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.loader import load_model

pytest.importorskip("transformers")
TOL = 2e-3
PROMPTS = [[3, 17, 5, 90, 44, 2, 61, 8, 8, 30, 71], [10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_dir("llama", tmp_path_factory.mktemp("logprobs") / "llama")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


def run(checkpoint, params: list[SamplingParams]) -> list[Sequence]:
    model = load_model(checkpoint, "cpu", dtype=torch.float32, prepack=False)
    engine = LLMEngine.create(model, EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8))
    return engine.run([Sequence(list(p), sp) for p, sp in zip(PROMPTS, params)])


def offline(checkpoint, seq: Sequence, temperature: float) -> torch.Tensor:
    """[num_output, vocab] float64 log-softmax at each completion position, from one causal forward."""
    logits = transformers_logits(checkpoint, seq.token_ids)[seq.num_prompt_tokens - 1:-1]
    return (logits / (temperature or 1.0)).log_softmax(dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_the_offline_forward(checkpoint, temperature):
    params = SamplingParams(temperature=temperature, seed=5, max_new_tokens=6, logprobs=True, top_logprobs=4)
    for seq in run(checkpoint, [params, params]):
        want = offline(checkpoint, seq, temperature)
        assert len(seq.output_logprobs) == len(seq.output_token_ids) == 6
        for pos, (token, entry) in enumerate(zip(seq.output_token_ids, seq.output_logprobs)):
            assert abs(entry.logprob - want[pos, token].item()) < TOL
            top_ids = [t for t, _ in entry.top]
            assert [v for _, v in entry.top] == pytest.approx(want[pos, top_ids].tolist(), abs=TOL)
            assert top_ids == want[pos].topk(4).indices.tolist()
            if temperature == 0.0:                     # greedy: the token drawn is the top-1
                assert top_ids[0] == token and entry.top[0][1] == entry.logprob
