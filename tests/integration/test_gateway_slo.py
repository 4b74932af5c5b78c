"""Latency targets at a real gateway (gRPC and OpenAI HTTP) over real Valkey, with a real
tokenizer server and a scripted worker (tests/integration/gateway_harness.py): fields and
headers are validated and carried to the work item, tenant defaults fill the gaps, early
refusal happens only for a tenant with shed_unmeetable, and goodput is counted."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import pytest
from gateway_harness import ANSWER, ScriptedWorker, start_tokenizer_server
from prometheus_client import REGISTRY

from gateway.__main__ import build
from gateway.config import GatewaySettings
from gateway.slo_estimate import MIN_SAMPLES
from gateway.tenants import hash_key
from llmserve.runtime import redis_client
from llmserve.runtime.server import start_server
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc
from tokenizer_svc.loader import load_tokenizer

# shed and keep have the same unmeetable default TTFT target (1 ms); only shed asks for refusal.
TENANTS = f"""
tenants:
  - {{id: plain, api_keys: ["sha256:{hash_key('plain-key')}"], requests_per_second: 1000, burst: 1000,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, models: ["*"]}}
  - {{id: shed, api_keys: ["sha256:{hash_key('shed-key')}"], requests_per_second: 1000, burst: 1000,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, models: ["*"],
     slo_ttft_ms: 1, slo_tpot_ms: 50, shed_unmeetable: true}}
  - {{id: keep, api_keys: ["sha256:{hash_key('keep-key')}"], requests_per_second: 1000, burst: 1000,
     tokens_per_minute: 10000000, max_concurrent: 16, max_new_tokens: 64, models: ["*"],
     slo_ttft_ms: 1, shed_unmeetable: false}}
"""
PLAIN, SHED, KEEP = ((("authorization", f"Bearer {t}-key"),) for t in ("plain", "shed", "keep"))
HI = [{"role": "user", "content": "Hi"}]


class Env:
    pass


@pytest.fixture(scope="module")
async def env(redis_url, smollm2_path, tmp_path_factory):
    e = Env()
    e.redis = redis_client.connect(redis_url)
    await e.redis.flushall()
    tokenizer = load_tokenizer(smollm2_path)
    e.tok_server, tok_target = await start_tokenizer_server(tokenizer)
    tenants = tmp_path_factory.mktemp("gw-slo") / "tenants.yaml"
    tenants.write_text(TENANTS)
    settings = GatewaySettings(tenants=str(tenants), tokenizer_target=tok_target, redis_url=redis_url,
                               models="smollm2-135m", http_port=-1, tokenizer_wait_s=30)
    e.service = build(settings)
    e.handle = await start_server(e.service, settings, settings.max_message_bytes)
    await e.service.start()
    await e.handle.set_serving(True)
    e.worker = ScriptedWorker(e.redis, tokenizer.encode(ANSWER))
    e.worker_task = await e.worker.start()
    e.channel = grpc.aio.insecure_channel(f"127.0.0.1:{e.handle.port}")
    e.stub = inference_pb2_grpc.InferenceStub(e.channel)
    e.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{e.service.http.port}", timeout=30)
    yield e
    await e.http.aclose()
    e.worker_task.cancel()
    await e.channel.close()
    await e.handle.server.stop(0)
    await e.service.close()
    await e.tok_server.stop(0)
    await e.redis.aclose()


def req(request_id: str, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="What is the capital of France?", request_id=request_id,
                              sampling=pb.SamplingParams(max_new_tokens=8), **fields)


async def complete(env, request, metadata) -> pb.CompleteResponse:
    return await env.stub.Complete(request, metadata=metadata, timeout=30)


async def error_of(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def item_of(env, request_id: str):
    return next(i for i in env.worker.items if i.request_id == request_id)


def slo_count(tenant: str, result: str) -> float:
    return REGISTRY.get_sample_value("llmserve_gateway_slo_requests_total",
                                     {"tenant": tenant, "priority": "normal", "result": result}) or 0.0


@pytest.mark.parametrize(("fields", "metadata", "name"), [
    ({"slo_ttft_ms": 3_600_001}, (), "slo_ttft_ms"),
    ({"slo_tpot_ms": 4_000_000_000}, (), "slo_tpot_ms"),
    ({}, (("x-slo-ttft-ms", "soon"),), "x-slo-ttft-ms"),
    ({}, (("x-slo-tpot-ms", "-5"),), "x-slo-tpot-ms"),
    ({}, (("x-slo-tpot-ms", "3600001"),), "x-slo-tpot-ms"),
])
async def test_out_of_range_targets_are_invalid_argument_naming_the_field(env, fields, metadata, name):
    err = await error_of(complete(env, req("", **fields), PLAIN + metadata))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{name}:")


async def test_fields_win_over_headers_and_headers_over_tenant_defaults(env):
    await complete(env, req("slo-fields", slo_ttft_ms=700), PLAIN + (("x-slo-ttft-ms", "900"),
                                                                     ("x-slo-tpot-ms", "40")))
    item = item_of(env, "slo-fields")
    assert (item.slo_ttft_ms, item.slo_tpot_ms) == (700, 40)
    await complete(env, req("slo-plain"), PLAIN)
    assert (item_of(env, "slo-plain").slo_ttft_ms, item_of(env, "slo-plain").slo_tpot_ms) == (0, 0)
    await complete(env, req("slo-keep-default"), KEEP + (("x-slo-tpot-ms", "30"),))
    item = item_of(env, "slo-keep-default")
    assert (item.slo_ttft_ms, item.slo_tpot_ms) == (1, 30)     # ttft from the tenant, tpot from the header


async def test_unmeetable_target_is_refused_early_only_when_the_tenant_asks(env):
    # Once enough requests like it (same prompt, a target as tight) were measured, a 1 ms TTFT is unmeetable.
    for n in range(MIN_SAMPLES):
        first = await complete(env, req(f"measured-{n}"), KEEP)
        assert first.usage.ttft_ms > 1
    refused = slo_count("shed", "refused")
    err = await error_of(complete(env, req("shed-second"), SHED))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "slo_ttft_ms" in err.details()
    assert int(dict(err.trailing_metadata())["retry-after-ms"]) >= 100
    assert slo_count("shed", "refused") == refused + 1
    assert all(i.request_id != "shed-second" for i in env.worker.items)
    # A field of 0 lifts the tenant's default target: nothing to refuse.
    await complete(env, req("shed-no-target", slo_ttft_ms=0), SHED)
    missed = slo_count("keep", "missed")
    for n in range(3):                           # same target, no shed_unmeetable: always served
        await complete(env, req(f"keep-{n}"), KEEP)
    assert slo_count("keep", "missed") == missed + 3


async def test_http_headers_are_validated_and_an_early_refusal_is_429(env):
    bad = await env.http.post("/v1/chat/completions", json={"messages": HI},
                              headers={"authorization": "Bearer plain-key", "x-slo-ttft-ms": "1.5"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-slo-ttft-ms"
    for _ in range(MIN_SAMPLES):                           # requests like the next one, measured
        measured = await env.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8},
                                       headers={"authorization": "Bearer keep-key", "x-slo-ttft-ms": "1"})
        assert measured.status_code == 200, measured.text
    refused = await env.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8},
                                  headers={"authorization": "Bearer shed-key", "x-slo-ttft-ms": "1"})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    served = await env.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8},
                                 headers={"authorization": "Bearer shed-key", "x-slo-ttft-ms": "0"})
    assert served.status_code == 200, served.text


async def test_goodput_counts_met_targets_per_tenant_and_priority(env):
    met = slo_count("plain", "met")
    await complete(env, req("plain-generous", slo_ttft_ms=60_000, slo_tpot_ms=60_000), PLAIN)
    await complete(env, req("plain-none"), PLAIN)            # no targets: met by finishing
    assert slo_count("plain", "met") == met + 2
    tokens = REGISTRY.get_sample_value("llmserve_gateway_tenant_tokens_total", {"tenant": "plain"})
    assert tokens and tokens > 0
