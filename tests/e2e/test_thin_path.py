"""The whole stack as processes on the real SmolLM2 model, through the public API."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.e2e

PARIS = [pb.ChatMessage(role="user", content="What is the capital of France?")]
GREEDY = pb.SamplingParams(temperature=0.0, max_new_tokens=24)


def stream(inference, auth, messages=PARIS, sampling=GREEDY, prompt=""):
    request = pb.GenerateRequest(messages=messages, prompt=prompt, sampling=sampling)
    return list(inference.Generate(request, metadata=auth, timeout=120))


def test_generate_streams_paris(inference, auth_metadata):
    chunks = stream(inference, auth_metadata)
    text = "".join(c.text for c in chunks)
    assert "Paris" in text
    assert chunks[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])


def test_indices_contiguous_and_usage_matches(inference, auth_metadata):
    chunks = stream(inference, auth_metadata)
    expected = 0
    for c in chunks:
        assert c.index == expected
        expected += len(c.token_ids)
    token_ids = [t for c in chunks for t in c.token_ids]
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(token_ids)
    assert usage.prompt_tokens > 0
    assert usage.total_ms >= usage.ttft_ms > 0
    assert len({c.request_id for c in chunks}) == 1 and chunks[0].request_id


def test_complete_matches_generate(inference, auth_metadata):
    request = pb.GenerateRequest(messages=PARIS, sampling=GREEDY)
    reply, call = inference.Complete.with_call(request, metadata=auth_metadata, timeout=120)
    assert "Paris" in reply.text
    assert reply.usage.completion_tokens == len(reply.token_ids)
    streamed = stream(inference, auth_metadata)
    assert reply.token_ids == [t for c in streamed for t in c.token_ids]
    assert reply.text == "".join(c.text for c in streamed)
    metadata = dict(call.initial_metadata())
    assert metadata["x-request-id"] == reply.request_id
    assert "x-ratelimit-remaining-requests" in metadata and "x-ratelimit-remaining-tokens" in metadata


def test_concurrent_requests_match_their_solo_runs(inference, auth_metadata):
    questions = ["What is the capital of France?", "Name three colors.", "What is 2+2?",
                 "Say hello in Spanish.", "What is the largest planet?", "Who wrote Hamlet?",
                 "What is water made of?", "Count from one to five."]
    requests = [pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=q)], sampling=GREEDY)
                for q in questions]
    solo = [inference.Complete(r, metadata=auth_metadata, timeout=120) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: inference.Complete(r, metadata=auth_metadata, timeout=180), requests))
    for alone, batched in zip(solo, together):
        assert batched.token_ids == alone.token_ids
        assert batched.text == alone.text


@pytest.mark.parametrize("metadata", [(("authorization", "Bearer wrong-key"),), ()])
def test_bad_api_key_is_unauthenticated(inference, metadata):
    with pytest.raises(grpc.RpcError) as err:
        inference.Complete(pb.GenerateRequest(prompt="hi", sampling=GREEDY), metadata=metadata, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
