"""logprobs on the shared stack (real SmolLM2), through gRPC and the official `openai` client.

The oracle: transformers' own Llama over the same GGUF file (its loader dequantizes Q4_1 to
fp32), one causal forward of prompt + completion. The worker computes with the file's Q4_1 blocks
on 8-bit codes of the activations per block of 32 (as llama.cpp does), in another summation order
(paged attention, batched steps). Measured on this model over 12 greedy positions, that moved the
sampled token's logprob by at most 0.069 and a top-5 alternative's by at most 0.42 (the rarest
ones move most); with 16-bit codes the gaps were 5e-4 and 2.5e-3. The tolerances are about 1.5x
the measured gaps: a logprob of another distribution (before temperature, another token's, not
normalised) is off by more, and the order and the top-1 token are checked exactly.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import openai
import pytest
import torch

from llmserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
TOL_SAMPLED = 0.1  # absolute, on the sampled token's logprob
TOL_TOP = 0.6  # absolute, on a top-5 alternative's


@pytest.fixture(scope="module")
def oracle(smollm2_path):
    transformers = pytest.importorskip("transformers")
    path = Path(smollm2_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)

    @torch.no_grad()
    def logprobs(prompt: list[int], completion: list[int]) -> torch.Tensor:
        """[len(completion), vocab] float64 log-softmax at each completion position."""
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
        return logits[len(prompt) - 1:-1].log_softmax(dim=-1)
    return logprobs


def chat_request(max_new: int = 12, top: int = 5) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content=PARIS[0]["content"])],
                              sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, logprobs=True,
                                                         top_logprobs=top))


def test_grpc_greedy_logprobs_match_the_offline_forward(inference, auth_metadata, oracle):
    request = chat_request()
    reply = inference.Complete(request, metadata=auth_metadata, timeout=180)
    prompt = list(inference.Tokenize(pb.TokenizeRequest(model=MODEL, messages=request.messages),
                                     metadata=auth_metadata, timeout=60).token_ids)
    assert len(reply.logprobs) == len(reply.token_ids) > 0
    want = oracle(prompt, list(reply.token_ids))
    for pos, (token, entry) in enumerate(zip(reply.token_ids, reply.logprobs)):
        assert entry.token_id == token and len(entry.top) == 5
        assert entry.top[0].token_id == token and entry.top[0].logprob == entry.logprob   # greedy: top-1 is it
        assert abs(entry.logprob - want[pos, token].item()) < TOL_SAMPLED
        for alt in entry.top:
            assert abs(alt.logprob - want[pos, alt.token_id].item()) < TOL_TOP
        assert [a.logprob for a in entry.top] == sorted((a.logprob for a in entry.top), reverse=True)
    assert "".join(e.token for e in reply.logprobs) == reply.text


def test_generate_stream_carries_one_entry_per_token(inference, auth_metadata):
    chunks = list(inference.Generate(chat_request(top=0), metadata=auth_metadata, timeout=180))
    whole = inference.Complete(chat_request(top=0), metadata=auth_metadata, timeout=180)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [e.logprob for c in chunks for e in c.logprobs] == [e.logprob for e in whole.logprobs]
    assert all(not e.top for e in whole.logprobs)


def test_sdk_chat_logprobs_streamed_and_not_agree_with_grpc(client, inference, auth_metadata):
    grpc_reply = inference.Complete(chat_request(top=3), metadata=auth_metadata, timeout=180)
    whole = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=12,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == [e.token for e in grpc_reply.logprobs]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in grpc_reply.logprobs], abs=1e-6)
    assert all(c.top_logprobs[0].token == c.token and len(c.top_logprobs) == 3 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode() == whole.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, stream=True)
        for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]


def test_sdk_chat_without_logprobs_gets_none(client):
    reply = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=4)
    assert reply.choices[0].logprobs is None


def test_sdk_legacy_completions_logprobs(client):
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=2)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8,
                                              logprobs=2, stream=True))
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset


@pytest.mark.parametrize(("kwargs", "param"), [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                                ({"top_logprobs": 2}, "top_logprobs")])
def test_sdk_top_logprobs_out_of_range_is_400_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=4, **kwargs)
    assert err.value.body["param"] == param


def test_grpc_top_logprobs_out_of_range_is_invalid_argument(inference, auth_metadata):
    with pytest.raises(grpc.RpcError) as err:
        inference.Complete(chat_request(top=21), metadata=auth_metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.top_logprobs" in err.value.details()
