"""The gateway over real gRPC and real Valkey, with a real tokenizer server and a
scripted worker writing real event streams (tests/integration/gateway_harness.py)."""

import asyncio
import contextlib
import dataclasses
import json
import time

import grpc
import pytest
from gateway_harness import ANSWER, MODEL, ScriptedWorker, start_tokenizer_server
from prometheus_client import REGISTRY

from gateway.__main__ import build
from gateway.config import GatewaySettings
from gateway.quota import tenant_keys
from gateway.tenants import hash_key
from gateway.validation import RequestLimits
from llmserve.protocol import keys
from llmserve.runtime import redis_client
from llmserve.runtime.server import start_server
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc
from tokenizer_svc.loader import load_tokenizer

TENANTS = f"""
tenants:
  - {{id: acme, api_keys: ["sha256:{hash_key('acme-key')}"], requests_per_second: 1000, burst: 1000,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, priority: normal, models: ["*"]}}
  - {{id: other, api_keys: ["sha256:{hash_key('other-key')}"], requests_per_second: 1000, burst: 1000,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, priority: normal, models: ["*"]}}
  - {{id: tiny, api_keys: ["sha256:{hash_key('tiny-key')}"], requests_per_second: 0.1, burst: 1,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, priority: normal, models: ["*"]}}
  - {{id: raw, api_keys: ["sha256:{hash_key('raw-key')}"], requests_per_second: 1000, burst: 1000,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, priority: normal, models: ["*"],
     raw_special_tokens: true}}
  - {{id: tok, api_keys: ["sha256:{hash_key('tok-key')}"], requests_per_second: 0.1, burst: 3,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, priority: normal, models: ["*"]}}
  - {{id: single, api_keys: ["sha256:{hash_key('single-key')}"], requests_per_second: 1000, burst: 1000,
     tokens_per_minute: 10000000, max_concurrent: 1, max_new_tokens: 64, priority: normal, models: ["*"]}}
  - {{id: schemer, api_keys: ["sha256:{hash_key('schemer-key')}"], requests_per_second: 0.01, burst: 2,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, priority: normal, models: ["*"]}}
  - {{id: fenced, api_keys: ["sha256:{hash_key('fenced-key')}"], requests_per_second: 10, burst: 10,
     tokens_per_minute: 100000, max_concurrent: 4, max_new_tokens: 64, priority: normal, models: ["llama-70b"]}}
"""
ACME = (("authorization", "Bearer acme-key"),)
OTHER = (("authorization", "Bearer other-key"),)
SHED_DEPTH = 40


class Env:
    pass


@pytest.fixture(scope="module")
async def env(redis_url, smollm2_path, tmp_path_factory):
    e = Env()
    e.redis = redis_client.connect(redis_url)
    await e.redis.flushall()
    e.model_tokenizer = load_tokenizer(smollm2_path)
    e.tok_server, tok_target = await start_tokenizer_server(e.model_tokenizer)
    tenants = tmp_path_factory.mktemp("gw") / "tenants.yaml"
    tenants.write_text(TENANTS)
    e.settings = GatewaySettings(tenants=str(tenants), tokenizer_target=tok_target, redis_url=redis_url,
                                 models=MODEL, detach_grace_s=0.5, cancel_grace_s=1.0, max_queue_wait_s=2.0,
                                 queue_max_depth=SHED_DEPTH, lease_ttl_s=10, tokenizer_wait_s=30)
    e.service = build(e.settings)
    e.handle = await start_server(e.service, e.settings, e.settings.max_message_bytes)
    await e.service.start()
    await e.handle.set_serving(True)
    e.target = f"127.0.0.1:{e.handle.port}"
    e.worker = ScriptedWorker(e.redis, e.model_tokenizer.encode(ANSWER))
    e.worker_task = await e.worker.start()
    e.channel = grpc.aio.insecure_channel(e.target, options=[("grpc.max_send_message_length", 32 << 20)])
    e.stub = inference_pb2_grpc.InferenceStub(e.channel)
    yield e
    e.worker_task.cancel()
    await e.channel.close()
    await e.handle.server.stop(0)
    await e.service.close()
    await e.tok_server.stop(0)
    await e.redis.aclose()


def req(request_id="", prompt="What is the capital of France?", **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_new_tokens", 64)
    return pb.GenerateRequest(prompt=prompt, request_id=request_id, sampling=pb.SamplingParams(**sampling))


async def stream(env, request, metadata=ACME, timeout=30):
    call = env.stub.Generate(request, metadata=metadata, timeout=timeout)
    chunks = [c async for c in call]
    return chunks, dict(await call.initial_metadata())


async def read_rest(call) -> list:
    out = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        out.append(chunk)
    return out


async def status_of(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


async def eventually(predicate, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.05)
    return False


def expected_ids(env, n=64):
    return env.model_tokenizer.encode(ANSWER)[:n]


async def test_generate_streams_contiguous_chunks_with_headers(env):
    chunks, md = await stream(env, req("plain-1"))
    assert [c.index for c in chunks] == [sum(len(x.token_ids) for x in chunks[:i]) for i in range(len(chunks))]
    assert [t for c in chunks for t in c.token_ids] == expected_ids(env)
    assert "".join(c.text for c in chunks) == ANSWER
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(expected_ids(env)) and usage.prompt_tokens > 0
    assert md["x-request-id"] == "plain-1" == chunks[0].request_id
    assert int(md["x-ratelimit-remaining-requests"]) >= 0 and int(md["x-ratelimit-remaining-tokens"]) > 0
    item = next(i for i in env.worker.items if i.request_id == "plain-1")
    assert list(item.sampling.stop_token_ids) == env.model_tokenizer.eos_token_ids
    assert item.sampling.max_new_tokens == 64 and item.tenant == "acme"
    assert item.events_key == keys.events_stream("acme", "plain-1")


async def test_complete_aggregates(env):
    served_ok = {"model": MODEL, "code": "OK"}
    before = REGISTRY.get_sample_value("llmserve_gateway_model_requests_total", served_ok) or 0.0
    call = env.stub.Complete(req("complete-1"), metadata=ACME, timeout=30)
    reply = await call
    assert reply.text == ANSWER and list(reply.token_ids) == expected_ids(env)
    assert reply.finish_reason == pb.FINISH_REASON_LENGTH and reply.request_id == "complete-1"
    headers = dict(await call.initial_metadata())
    assert headers["x-request-id"] == "complete-1" and headers["x-served-model"] == MODEL
    assert REGISTRY.get_sample_value("llmserve_gateway_model_requests_total", served_ok) == before + 1


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer nope"),), (("authorization", "acme-key"),)])
async def test_unauthenticated_carries_request_id(env, metadata):
    call = env.stub.Generate(req("auth-1"), metadata=metadata, timeout=10)
    err = await status_of(call.read())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dict(await call.initial_metadata())["x-request-id"] == "auth-1"


@pytest.mark.parametrize("request_id", ["é", "a\nb", "±\x1a", "x" * 5000])
@pytest.mark.parametrize("metadata, code", [(ACME, grpc.StatusCode.INVALID_ARGUMENT),
                                            ((), grpc.StatusCode.UNAUTHENTICATED)])
async def test_malformed_request_id_is_rejected_not_internal(env, request_id, metadata, code):
    call = env.stub.Generate(req(request_id), metadata=metadata, timeout=10)
    err = await status_of(call.read())
    assert err.code() == code
    assert dict(await call.initial_metadata())["x-request-id"] == "-"


async def test_model_not_allowed_and_unknown(env):
    err = await status_of(env.stub.Complete(req(), metadata=(("authorization", "Bearer fenced-key"),), timeout=10))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    bad = req()
    bad.model = "no-such-model"
    err = await status_of(env.stub.Complete(bad, metadata=ACME, timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.details()


@pytest.mark.parametrize("request_, field", [
    (req(prompt="x" * (10 * 1024 * 1024)), "prompt"),
    (req(max_new_tokens=65), "sampling.max_new_tokens"),           # tenant cap 64
    (req(prompt="hi " * 9000), "prompt"),                           # more tokens than the 8192 context
    (req(top_p=0.0), "sampling.top_p"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="bot", content="x")]), "messages[0].role"),
])
async def test_validation_over_grpc(env, request_, field):
    err = await status_of(env.stub.Complete(request_, metadata=ACME, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":")


async def test_invalid_utf8_bytes_name_the_field(env):
    raw = pb.GenerateRequest(prompt="AB").SerializeToString().replace(b"AB", b"A\xff")
    method = env.channel.unary_unary("/llmserve.v1.Inference/Complete", request_serializer=lambda b: b,
                                     response_deserializer=pb.CompleteResponse.FromString)
    err = await status_of(method(raw, metadata=ACME, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt:")


async def test_rate_limit_is_resource_exhausted_with_retry_after(env):
    tiny = (("authorization", "Bearer tiny-key"),)
    await env.stub.Complete(req(), metadata=tiny, timeout=30)
    call = env.stub.Complete(req(), metadata=tiny, timeout=30)
    err = await status_of(call)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_second" in err.details()
    assert 0 < int(dict(err.trailing_metadata())["retry-after-ms"]) <= 10_000
    assert "x-request-id" in dict(await call.initial_metadata())


async def test_stop_string_across_tokens_sets_cancel(env):
    chunks, _ = await stream(env, req("stop-1", stop=["Paris"]))
    assert "".join(c.text for c in chunks) == "The capital of France is "
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    assert await eventually(lambda: env.redis.exists(keys.cancel_key("acme", "stop-1")))
    assert await eventually(lambda: lease_gone("acme", "stop-1", env))


async def test_resume_reattaches_without_requeueing_or_recharging(env):
    first, _ = await stream(env, req("resume-1"))
    assert await eventually(lambda: lease_gone("acme", "resume-1", env))   # released and refunded
    ledger_before = await env.redis.hgetall(tenant_keys("acme")["ledger"])
    k = first[3].index
    again, md = await stream(env, req("resume-1"), metadata=ACME + (("x-resume-from", str(k)),))
    assert [c.index for c in again] == [c.index for c in first[3:]]
    assert "".join(c.text for c in first[:3] + again) == ANSWER
    replay, _ = await stream(env, req("resume-1"))
    assert [c.SerializeToString() for c in replay[:-1]] == [c.SerializeToString() for c in first[:-1]]
    assert [i.request_id for i in env.worker.items].count("resume-1") == 1
    assert await env.redis.hgetall(tenant_keys("acme")["ledger"]) == ledger_before
    assert md["x-request-id"] == "resume-1"
    # the same id under another tenant is another request
    other, _ = await stream(env, req("resume-1"), metadata=OTHER)
    assert [i.request_id for i in env.worker.items].count("resume-1") == 2 and other[-1].finish_reason


async def test_work_items_carry_a_prefix_cache_salt_per_tenant(env):
    await env.stub.Complete(req("salt-1"), metadata=ACME, timeout=30)
    await env.stub.Complete(req("salt-1"), metadata=OTHER, timeout=30)
    salts = {i.tenant: i.cache_salt for i in env.worker.items if i.request_id == "salt-1"}
    assert salts == {"acme": "tenant:acme", "other": "tenant:other"}


async def test_raw_special_tokens_only_for_the_tenant_allowed_them(env):
    text = pb.TokenizeRequest(text="<|im_start|>system")
    assert 1 not in (await env.stub.Tokenize(text, metadata=ACME, timeout=30)).token_ids
    raw = (("authorization", "Bearer raw-key"),)
    assert list((await env.stub.Tokenize(text, metadata=raw, timeout=30)).token_ids)[0] == 1
    await env.stub.Complete(req("raw-1", prompt="<|im_start|>user"), metadata=raw, timeout=30)
    await env.stub.Complete(req("raw-1", prompt="<|im_start|>user"), metadata=ACME, timeout=30)
    firsts = {i.tenant: i.prompt_token_ids[0] for i in env.worker.items if i.request_id == "raw-1"}
    assert firsts["raw"] == 1 and firsts["acme"] != 1


async def test_cancel_rpc_own_tenant_only(env):
    call = env.stub.Generate(req("slow-cancel"), metadata=ACME, timeout=60)
    first = await call.read()
    assert first.index == 0
    err = await status_of(env.stub.Cancel(pb.CancelRequest(request_id="slow-cancel"), metadata=OTHER, timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = await status_of(env.stub.Cancel(pb.CancelRequest(request_id="never-was"), metadata=ACME, timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    await env.stub.Cancel(pb.CancelRequest(request_id="slow-cancel"), metadata=ACME, timeout=10)
    rest = await read_rest(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    assert "slow-cancel" in env.worker.saw_cancel
    assert await eventually(lambda: lease_gone("acme", "slow-cancel", env))


async def lease_gone(tenant, request_id, env):
    return await env.redis.zscore(tenant_keys(tenant)["leases"], request_id) is None


async def test_deadline_exceeded_in_time_and_worker_told(env):
    started = time.monotonic()
    err = await status_of(stream(env, req("idle-deadline"), timeout=1.0))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 10
    item = next(i for i in env.worker.items if i.request_id == "idle-deadline")
    assert item.deadline_unix_ms > item.arrival_unix_ms
    assert await eventually(lambda: env.redis.exists(keys.cancel_key("acme", "idle-deadline")))
    assert await eventually(lambda: lease_gone("acme", "idle-deadline", env))


async def test_disconnect_cancels_and_frees_lease(env):
    call = env.stub.Generate(req("slow-disconnect"), metadata=ACME, timeout=60)
    await call.read()
    call.cancel()
    assert await eventually(lambda: env.redis.exists(keys.cancel_key("acme", "slow-disconnect")))
    assert await eventually(lambda: lease_gone("acme", "slow-disconnect", env))
    assert await eventually(lambda: _async_true("slow-disconnect" in env.worker.saw_cancel))


async def _async_true(value):
    return value


async def test_max_queue_wait_is_unavailable(env):
    err = await status_of(stream(env, req("idle-queue"), timeout=30))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "overloaded" in err.details()
    assert await eventually(lambda: lease_gone("acme", "idle-queue", env))
    assert await eventually(lambda: env.redis.exists(keys.cancel_key("acme", "idle-queue")))   # batcher drops it
    again = await status_of(stream(env, req("idle-queue"), timeout=30))   # a retry re-attaches: same answer
    assert again.code() == grpc.StatusCode.UNAVAILABLE and again.details() == err.details()


async def test_worker_error_event_maps_to_status(env):
    err = await status_of(stream(env, req("err-1")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "boom" in err.details()


async def test_shedding_keeps_share_for_high(env):
    stream_key = keys.work_stream(MODEL, pb.PRIORITY_LOW)
    for _ in range(int(SHED_DEPTH * 0.75)):
        await env.redis.xadd(stream_key, {"filler": "1"})
    try:
        err = await status_of(env.stub.Complete(req(), metadata=ACME, timeout=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "overloaded" in err.details()
        high = req("high-1")
        high.priority = pb.PRIORITY_HIGH
        reply = await env.stub.Complete(high, metadata=ACME, timeout=30)
        assert reply.text == ANSWER
    finally:
        await env.redis.delete(stream_key)


async def test_list_models_and_tokenize(env):
    reply = await env.stub.ListModels(pb.ListModelsRequest(), metadata=ACME, timeout=10)
    assert [(m.id, m.context_length) for m in reply.models] == [(MODEL, env.model_tokenizer.context_length)]
    fenced = await env.stub.ListModels(pb.ListModelsRequest(), metadata=(("authorization", "Bearer fenced-key"),))
    assert list(fenced.models) == []
    tok = await env.stub.Tokenize(pb.TokenizeRequest(text="Hello world"), metadata=ACME, timeout=10)
    assert list(tok.token_ids) == env.model_tokenizer.encode("Hello world")
    err = await status_of(env.stub.Tokenize(pb.TokenizeRequest(), metadata=ACME, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("text:")


async def test_sighup_reload_keeps_streams(env, tmp_path):
    path = env.service.gateway.tenants.path
    original = path.read_text()
    call = env.stub.Generate(req("slow-sighup", max_new_tokens=20), metadata=ACME, timeout=60)
    await call.read()
    try:
        path.write_text(original + f"""  - {{id: late, api_keys: ["sha256:{hash_key('late-key')}"], requests_per_second: 5,
     burst: 5, tokens_per_minute: 100000, max_concurrent: 2, max_new_tokens: 64, models: ["*"]}}
""")
        import os
        import signal
        os.kill(os.getpid(), signal.SIGHUP)
        assert await eventually(lambda: _async_true("late" in env.service.gateway.tenants.tenant_ids()))
        rest = await read_rest(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 20
        await env.stub.ListModels(pb.ListModelsRequest(), metadata=(("authorization", "Bearer late-key"),))
    finally:
        path.write_text(original)
        env.service.gateway.tenants.reload()


async def test_dispatched_request_outlives_max_queue_wait(env):
    """Past max_queue_wait_s a request that left the work stream (dispatched, e.g. in a long prefill) goes on."""
    chunks, _ = await stream(env, req("late-longwait"))   # first event after 3 s > max_queue_wait_s (2 s)
    assert "".join(c.text for c in chunks) == ANSWER and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


# -- everything metered: Tokenize, re-attach, streams per tenant ------------------------------------------
TOK = (("authorization", "Bearer tok-key"),)
SINGLE = (("authorization", "Bearer single-key"),)


async def test_tokenize_flood_is_resource_exhausted_and_spends_the_request_rate(env):
    calls = [env.stub.Tokenize(pb.TokenizeRequest(text=f"flood {i}"), metadata=TOK, timeout=30) for i in range(12)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert 3 <= len(results) - len(refused) <= 4                    # burst 3 (and one more per 10 s)
    assert refused and {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "requests_per_second" in refused[0].details()
    assert 0 < int(dict(refused[0].trailing_metadata())["retry-after-ms"]) <= 10_000
    # one rate for both: the flood used up the tenant's Generate budget too, and nobody else's
    err = await status_of(env.stub.Complete(req(), metadata=TOK, timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await env.stub.Tokenize(pb.TokenizeRequest(text="fine"), metadata=ACME, timeout=30)).token_ids


async def leases_of(env, tenant) -> int:
    return await env.redis.zcard(tenant_keys(tenant)["leases"])


async def test_reattach_beyond_max_concurrent_is_refused(env):
    call = env.stub.Generate(req("slow-attach", max_new_tokens=40), metadata=SINGLE, timeout=60)
    assert (await call.read()).index == 0
    # a second viewer of the running request needs a lease of its own: the tenant's only one is taken
    err = await status_of(stream(env, req("slow-attach", max_new_tokens=40), metadata=SINGLE))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in err.details()
    assert int(dict(err.trailing_metadata())["retry-after-ms"]) > 0
    rest = await read_rest(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert await eventually(lambda: lease_gone("single", "slow-attach", env))
    # the request finished and gave its lease back: a replay holds one while attached, then frees it
    replay, _ = await stream(env, req("slow-attach", max_new_tokens=40), metadata=SINGLE)
    assert replay[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert await eventually(lambda: _async_true_after(leases_of(env, "single"), 0))


async def _async_true_after(count, expected) -> bool:
    return await count == expected


async def test_replay_of_a_finished_request_needs_a_free_lease(env):
    await env.stub.Complete(req("single-replay"), metadata=SINGLE, timeout=30)
    assert await eventually(lambda: lease_gone("single", "single-replay", env))
    busy = env.stub.Generate(req("slow-single-busy", max_new_tokens=30), metadata=SINGLE, timeout=60)
    await busy.read()
    # the tenant's one lease is taken by the running request: replaying a finished one is refused
    err = await status_of(stream(env, req("single-replay"), metadata=SINGLE))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in err.details()
    await read_rest(busy)
    assert await eventually(lambda: _async_true_after(leases_of(env, "single"), 0))
    replay, _ = await stream(env, req("single-replay"), metadata=SINGLE)
    assert replay[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_resume_after_a_disconnect_carries_the_requests_lease_on(env):
    """The resume story still works at max_concurrent 1: a lone resumer takes over the lease."""
    call = env.stub.Generate(req("slow-resume", max_new_tokens=30), metadata=SINGLE, timeout=60)
    await call.read()
    call.cancel()
    meta_key = keys.request_meta("single", "slow-resume")
    assert await eventually(lambda: _async_true_after(env.redis.hget(meta_key, "viewers"), b"0"))
    chunks, _ = await stream(env, req("slow-resume", max_new_tokens=30), metadata=SINGLE)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].usage.completion_tokens == 30
    assert await eventually(lambda: _async_true_after(leases_of(env, "single"), 0))


async def test_one_tenant_cannot_take_every_stream_of_a_gateway(env):
    settings = dataclasses.replace(env.settings, max_tenant_streams=2)
    service = build(settings)
    handle = await start_server(service, settings, settings.max_message_bytes)
    await service.start()
    await handle.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    held = [stub.Generate(req(f"slow-cap-{i}"), metadata=ACME, timeout=60) for i in range(2)]
    try:
        for call in held:
            await call.read()
        err = await status_of(stub.Complete(req(), metadata=ACME, timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tenant_streams" in err.details()
        assert int(dict(err.trailing_metadata())["retry-after-ms"]) > 0
        # a re-attach counts as a stream too
        err = await status_of(stub.Complete(req("slow-cap-0"), metadata=ACME, timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # another tenant still streams through this gateway
        assert (await stub.Complete(req(), metadata=OTHER, timeout=30)).text == ANSWER
        held.pop().cancel()
        assert await eventually(lambda: _async_true(service.gateway.flow.streams.open["acme"] == 1))
        assert (await stub.Complete(req(), metadata=ACME, timeout=30)).text == ANSWER
    finally:
        for call in held:
            call.cancel()
        await channel.close()
        await handle.server.stop(0)
        await service.close()


async def test_a_dropped_redis_connection_leaves_the_request_resumable(env):
    """Redis drops the gateway's reading connection mid-stream: the caller gets UNAVAILABLE and
    resumes within detach_grace_s, and the request runs to its end instead of being cancelled."""
    call = env.stub.Generate(req("slow-dropped", max_new_tokens=30), metadata=ACME, timeout=60)
    chunks = [await call.read() for _ in range(3)]
    dropper = asyncio.create_task(drop_blocked_reads(env))   # until the gateway's read is among them
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
    finally:
        dropper.cancel()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    seen = chunks[-1].index + len(chunks[-1].token_ids)
    rest, _ = await stream(env, req("slow-dropped", max_new_tokens=30),
                           metadata=ACME + (("x-resume-from", str(seen)),))
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 30
    assert not await env.redis.exists(keys.cancel_key("acme", "slow-dropped"))


async def drop_blocked_reads(env) -> None:
    """Every 10 ms, CLIENT KILL the connections blocked in XREAD (the gateway's event reads, and the
    scripted worker's, which reconnects): a read the gateway is not blocked in at one moment is at
    the next."""
    while True:
        clients = await env.redis.client_list()
        ids = [c["id"] for c in clients if c.get("cmd") == "xread" and "b" in c.get("flags", "")]
        if ids:
            await env.redis.execute_command("CLIENT", "KILL", "ID", *ids)
        await asyncio.sleep(0.01)


# -- admission order: cheap checks first; compiles off the loop and charged -----------------------------
def big_schema(tag: str, fields: int = 900) -> pb.ResponseFormat:
    """A unique JSON schema of ~58 KB (patterns make its lexer costly to build)."""
    props = {f"{tag}_{k}": {"type": "string", "pattern": f"[a-z]{{1,{k % 20 + 1}}}x{k}"} for k in range(fields)}
    schema = json.dumps({"type": "object", "properties": props, "required": list(props)[:50]})
    assert 50_000 < len(schema) < RequestLimits().max_response_format_bytes
    return pb.ResponseFormat(json_schema=schema)


def with_format(fmt: pb.ResponseFormat, **kw) -> pb.GenerateRequest:
    request = req(**kw)
    request.sampling.response_format.CopyFrom(fmt)
    return request


def compiles(tenant: str) -> float:
    return sum(REGISTRY.get_sample_value("llmserve_gateway_grammar_compiles_total",
                                         {"tenant": tenant, "result": result}) or 0.0
               for result in ("ok", "invalid", "timeout"))


def compiles_in_flight() -> float:
    return REGISTRY.get_sample_value("llmserve_gateway_grammar_compiles_in_flight")


async def test_a_rate_limited_tenants_schema_is_refused_for_rate_without_compiling(env):
    tiny = (("authorization", "Bearer tiny-key"),)
    for _ in range(2):                 # burst 1 at 0.1/s: at most one of these is admitted
        with contextlib.suppress(grpc.aio.AioRpcError):
            await env.stub.Complete(req(), metadata=tiny, timeout=30)
    misses = env.service.gateway.formats.cache.misses
    err = await status_of(env.stub.Complete(with_format(big_schema("tiny")), metadata=tiny, timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests_per_second" in err.details()
    assert compiles("tiny") == 0 and env.service.gateway.formats.cache.misses == misses


async def test_a_failed_compile_is_charged_to_the_tenant(env):
    """schemer may make 2 requests (then one per 100 s): two invalid schemas spend them both."""
    schemer = (("authorization", "Bearer schemer-key"),)
    for i in range(2):
        bad = pb.ResponseFormat(json_schema=json.dumps({"type": "integer", "minimum": 5 + i, "maximum": 1}))
        err = await status_of(env.stub.Complete(with_format(bad), metadata=schemer, timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("sampling.response_format")
    assert compiles("schemer") == 2
    err = await status_of(env.stub.Complete(req(), metadata=schemer, timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests_per_second" in err.details()


async def test_other_tenants_are_served_while_big_schemas_compile(env):
    """Six unique 58 KB schemas queue on the compile thread; meanwhile the event loop goes on
    answering another tenant (a ListModels call, a stream's tokens) before the compiles are done."""
    assert compiles_in_flight() == 0
    stream_call = env.stub.Generate(req("slow-beside-compiles", max_new_tokens=64), metadata=OTHER, timeout=60)
    await stream_call.read()
    compiling = [asyncio.ensure_future(env.stub.Complete(with_format(big_schema(f"s{i}"), max_new_tokens=4),
                                                         metadata=ACME, timeout=60)) for i in range(6)]
    assert await eventually(lambda: _async_true(compiles_in_flight() >= 1))
    reply = await env.stub.ListModels(pb.ListModelsRequest(), metadata=OTHER, timeout=10)
    chunk = await stream_call.read()
    assert compiles_in_flight() >= 1, "the event loop answered only after every compile was done"
    assert reply.models and chunk.token_ids
    stream_call.cancel()
    replies = await asyncio.gather(*compiling)
    assert all(r.token_ids for r in replies)
