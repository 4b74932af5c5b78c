"""The OpenAI-compatible HTTP endpoint on the shared stack, through the official `openai`
client: Paris, streaming with usage, the same text as gRPC, each error as its own exception
class, one quota across both protocols, and a disconnect that cancels the request."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import redis
from test_gateway_e2e import running_sequences, wait_until

from llmserve.loadgen.streams import PROMPTS
from llmserve.protocol import keys, queue
from llmserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def other_key(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_chat_completion_answers_paris_with_usage_and_headers(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=PARIS, temperature=0,
                                                            max_tokens=16)
    reply = raw.parse()
    assert "Paris" in reply.choices[0].message.content
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert raw.headers["x-request-id"] and int(raw.headers["x-ratelimit-remaining-requests"]) >= 0
    assert "x-ratelimit-remaining-tokens" in raw.headers


def test_streamed_chat_equals_the_whole_one_and_ends_with_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_and_models(client):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text.strip()
    assert MODEL in [m.id for m in client.models.list()]


def test_same_greedy_text_over_http_and_grpc(client, inference, auth_metadata):
    for prompt in PROMPTS[:8]:
        messages = [{"role": "user", "content": prompt}]
        over_http = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
        over_grpc = inference.Complete(
            pb.GenerateRequest(messages=[pb.ChatMessage(**messages[0])],
                               sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=24)),
            metadata=auth_metadata, timeout=180)
        assert over_http.choices[0].message.content == over_grpc.text, prompt


def test_each_error_is_its_own_exception_class(stack, client):
    with pytest.raises(openai.AuthenticationError):
        other_key(stack, "no-such-key").chat.completions.create(model=MODEL, messages=PARIS)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=PARIS, temperature="hot")
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 3}])
    assert bad.value.body["param"] == "messages[0].content"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=PARIS)
    with pytest.raises(openai.PermissionDeniedError):
        other_key(stack, "restricted-key").chat.completions.create(model=MODEL, messages=PARIS)


def test_one_quota_across_grpc_and_http(stack, inference):
    """http-metered may make 2 requests at once and 1 per 20 s: gRPC spends them, HTTP gets 429."""
    metadata = (("authorization", "Bearer http-metered-key"),)
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_new_tokens=1))
    codes = []
    for _ in range(4):
        try:
            inference.Complete(request, metadata=metadata, timeout=60)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED, codes
    with pytest.raises(openai.RateLimitError) as limited:
        other_key(stack, "http-metered-key").chat.completions.create(model=MODEL, messages=PARIS, max_tokens=1)
    assert int(limited.value.response.headers["retry-after"]) >= 1


def test_client_disconnect_cancels_the_request(client, stack):
    valkey = redis.Redis.from_url(stack.redis_url)
    try:
        story = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
        stream = client.chat.completions.create(model=MODEL, messages=story, temperature=0, max_tokens=400,
                                                stream=True)
        for _, _chunk in zip(range(4), stream):
            pass
        assert wait_until(lambda: running_sequences(valkey, stack.model_id) >= 1, 30)
        stream.close()
        assert wait_until(lambda: running_sequences(valkey, stack.model_id) == 0, 60), \
            "the worker kept generating for a closed HTTP stream"
        events = valkey.xrange(keys.events_stream("dev", stream.response.headers["x-request-id"]))
        final = queue.decode_event(events[-1][1])
        assert final.final and final.finish_reason == pb.FINISH_REASON_CANCELLED
    finally:
        valkey.close()


def test_liveness_and_readiness(stack):
    for path in ("/health", "/ready"):
        with urllib.request.urlopen(stack.http_url + path, timeout=10) as reply:
            assert reply.status == 200 and json.load(reply)["status"] in ("ok", "serving")


def test_ignore_eos_generates_every_requested_token(client):
    """Benchmarks ask for fixed output lengths (vLLM's `ignore_eos`); without it the answer stops early."""
    messages = [{"role": "user", "content": "What is 2+2?"}]
    short = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48)
    assert short.usage.completion_tokens < 48 and short.choices[0].finish_reason == "stop"
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48,
                                          extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 48 and full.choices[0].finish_reason == "length"
