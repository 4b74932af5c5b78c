"""n > 1 on the shared stack (real SmolLM2): separate, reproducible choices that share one prefill,
charged per choice, through gRPC and the official `openai` client."""

from __future__ import annotations

import uuid

import grpc
import openai
import pytest
from test_gateway_e2e import wait_until

from llmserve.protocol import keys, queue
from llmserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
BLOCK = 16                     # the worker's KV block size (default)
TEAM_B = (("authorization", "Bearer team-b-key"),)


def seeded(n: int, text: str, request_id: str = "", max_new: int = 10) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, n=n, request_id=request_id,
                              messages=[pb.ChatMessage(role="user", content=text)],
                              sampling=pb.SamplingParams(temperature=1.0, seed=1234, max_new_tokens=max_new,
                                                         ignore_eos=True))


def test_seeded_choices_reproduce_differ_and_sum_in_usage(inference, auth_metadata):
    first = inference.Complete(seeded(3, "Tell me a story."), metadata=auth_metadata, timeout=180)
    again = inference.Complete(seeded(3, "Tell me a story."), metadata=auth_metadata, timeout=180)
    ids = [list(c.token_ids) for c in first.choices]
    assert [c.choice_index for c in first.choices] == [0, 1, 2]
    assert ids == [list(c.token_ids) for c in again.choices]            # each choice reproduces
    assert len({tuple(i) for i in ids}) == 3                            # and they differ
    assert first.usage.completion_tokens == sum(len(i) for i in ids) == 30
    assert (first.text, list(first.token_ids)) == (first.choices[0].text, ids[0])
    # choice 0 of n = 3 is the n = 1 request: seed + 0
    alone = inference.Complete(seeded(1, "Tell me a story."), metadata=auth_metadata, timeout=180)
    assert list(alone.token_ids) == ids[0]


def test_choices_share_one_prefill_on_one_worker(inference, auth_metadata, valkey_client):
    request_id = f"n-prefix-{uuid.uuid4().hex[:8]}"
    text = f"Reference {uuid.uuid4().hex}: write one sentence about the sea."   # cold in the prefix cache
    inference.Complete(seeded(4, text, request_id, max_new=4), metadata=auth_metadata, timeout=180)
    events = [queue.decode_event(f) for _, f in valkey_client.xrange(keys.events_stream("dev", request_id))]
    first = {e.choice_index: e for e in reversed(events) if e.prompt_tokens}
    prompt = first[0].prompt_tokens
    full = (prompt - 1) // BLOCK * BLOCK
    assert sorted(first) == [0, 1, 2, 3] and full > 0
    assert first[0].cached_prompt_tokens < full          # (the chat template's system prompt may be warm)
    assert [first[i].cached_prompt_tokens for i in (1, 2, 3)] == [full] * 3   # computed once, by choice 0
    assert len({e.worker_id for e in events}) == 1


def test_quota_reserves_each_choice_and_refunds_the_unused(inference, valkey_client):
    ledger = keys.tenant_key("team-b", "ledger")
    before = [int(v or 0) for v in valkey_client.hmget(ledger, "reserved", "refunded")]
    request_id = f"n-quota-{uuid.uuid4().hex[:8]}"
    reply = inference.Complete(seeded(3, "Count to ten.", request_id, max_new=8), metadata=TEAM_B, timeout=180)
    assert wait_until(lambda: not valkey_client.hexists(keys.tenant_key("team-b", "reserved"), request_id))
    reserved, refunded = (int(v) - b for v, b in zip(valkey_client.hmget(ledger, "reserved", "refunded"), before))
    prompt = reply.usage.prompt_tokens
    assert reserved == 3 * (prompt + 8)
    assert reserved - refunded == 3 * prompt + reply.usage.completion_tokens


def _worker_final(valkey_client, request_id: str, choice: int):
    """The worker's final event of one choice (None until written): index + its tokens = what it generated."""
    events = [queue.decode_event(f) for _, f in valkey_client.xrange(keys.events_stream("dev", request_id))]
    return next((e for e in events if e.choice_index == choice and e.final), None)


def test_a_choice_ended_by_a_stop_string_stops_generating(inference, auth_metadata, valkey_client):
    max_new = 192
    free = inference.Complete(seeded(2, "Describe a city.", max_new=max_new), metadata=auth_metadata, timeout=300)
    first, second = (c.text for c in free.choices)
    # a stop string early in choice 0 that choice 1 never writes: choice 0 stops, choice 1 runs on
    stop = next(first[k:k + 6] for k in range(4, len(first) - 6) if first[k:k + 6] not in second)
    request = seeded(2, "Describe a city.", f"n-stop-{uuid.uuid4().hex[:8]}", max_new=max_new)
    request.sampling.stop.append(stop)
    reply = inference.Complete(request, metadata=auth_metadata, timeout=300)
    stopped, running = reply.choices
    assert stopped.finish_reason == pb.FINISH_REASON_STOP and stopped.text == first[:first.index(stop)]
    assert running.finish_reason == pb.FINISH_REASON_LENGTH and len(running.token_ids) == max_new
    assert reply.usage.completion_tokens == len(stopped.token_ids) + max_new     # only what was taken
    assert wait_until(lambda: _worker_final(valkey_client, request.request_id, 0) is not None)
    final = _worker_final(valkey_client, request.request_id, 0)
    # the worker ended choice 0 on the gateway's word, long before max_new_tokens
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert final.index + len(final.token_ids) < max_new


def test_generate_stream_names_each_choice_and_cancel_ends_them_all(inference, auth_metadata):
    request_id = f"n-cancel-{uuid.uuid4().hex[:8]}"
    stream = inference.Generate(seeded(3, "Write a very long essay.", request_id, max_new=2000),
                                metadata=auth_metadata, timeout=300)
    seen: dict[int, list[pb.GenerateResponse]] = {}
    for chunk in stream:
        seen.setdefault(chunk.choice_index, []).append(chunk)
        if len(seen) == 3 and request_id:
            inference.Cancel(pb.CancelRequest(request_id=request_id), metadata=auth_metadata, timeout=30)
            request_id = ""
    for chunks in seen.values():
        assert [c.index for c in chunks] == [sum(len(c.token_ids) for c in chunks[:k]) for k in range(len(chunks))]
        assert chunks[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    assert sorted(seen) == [0, 1, 2]


def test_resume_reattaches_to_every_choice(inference, auth_metadata):
    request_id = f"n-resume-{uuid.uuid4().hex[:8]}"
    first = list(inference.Generate(seeded(2, "Name a color.", request_id, max_new=6), metadata=auth_metadata,
                                    timeout=180))
    again = list(inference.Generate(seeded(2, "Name a color.", request_id, max_new=6), metadata=auth_metadata,
                                    timeout=180))

    def per_choice(chunks):
        return {i: [t for c in chunks if c.choice_index == i for t in c.token_ids] for i in (0, 1)}
    assert per_choice(again) == per_choice(first) and all(len(v) == 6 for v in per_choice(first).values())


def test_sdk_chat_and_completions_n_streamed_and_not(client):
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=7, max_tokens=6,
                                           temperature=1.0, logprobs=True)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) > 0 for c in whole.choices)
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=3, seed=7, max_tokens=6,
                                                temperature=1.0, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    legacy = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=3, max_tokens=5,
                                       temperature=1.0)
    assert [c.index for c in legacy.choices] == [0, 1]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=3, max_tokens=5,
                                           temperature=1.0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in legacy.choices}


def test_n_out_of_range_names_n(client, inference, auth_metadata):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17, max_tokens=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(grpc.RpcError) as rpc:
        inference.Complete(seeded(17, "x"), metadata=auth_metadata, timeout=60)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and rpc.value.details().startswith("n")
