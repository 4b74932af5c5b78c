"""Quotas across three `python -m gateway` processes sharing one Valkey: 64
callers against a tenant with rate 5/s, burst 10, max_concurrent 4; leases of a
gateway killed with -9 come back after their TTL. Real tokenizer_svc process;
the worker side is the scripted worker of gateway_harness (it counts the peak
of requests it serves at once)."""

import asyncio
import time
import urllib.request
import uuid

import grpc
import pytest
from gateway_harness import ANSWER, MODEL, ScriptedWorker

from gateway.tenants import hash_key
from llmserve.local.stack import ServiceProcess
from llmserve.local.valkey import free_port
from llmserve.runtime import redis_client
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc
from tokenizer_svc.loader import load_tokenizer

RATE, BURST, MAX_CONCURRENT = 5, 10, 4
TENANTS = f"""
tenants:
  - {{id: shared, api_keys: ["sha256:{hash_key('shared-key')}"], requests_per_second: {RATE}, burst: {BURST},
     tokens_per_minute: 10000000, max_concurrent: {MAX_CONCURRENT}, max_new_tokens: 64, models: ["*"]}}
  - {{id: crashy, api_keys: ["sha256:{hash_key('crashy-key')}"], requests_per_second: 100, burst: 100,
     tokens_per_minute: 10000000, max_concurrent: 2, max_new_tokens: 64, models: ["*"]}}
"""
SHARED = (("authorization", "Bearer shared-key"),)
CRASHY = (("authorization", "Bearer crashy-key"),)


@pytest.fixture(scope="module")
async def cluster(redis_url, smollm2_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gwp")
    tenants = logs / "tenants.yaml"
    tenants.write_text(TENANTS)
    redis = redis_client.connect(redis_url)
    await redis.flushall()
    deadline = time.monotonic() + 240
    common = ["--host", "127.0.0.1", "--redis-url", redis_url]
    tok = ServiceProcess("tokenizer_svc", "tokenizer_svc", [*common, "--models", MODEL, "--workers", "1"], 0,
                         logs / "tok.log", None)
    procs = [tok.start()]
    gateways = []
    try:
        await asyncio.to_thread(tok.wait_serving, deadline)
        for i in range(3):
            metrics_port = free_port()
            gw = ServiceProcess(f"gateway-{i}", "gateway", [*common, "--tenants", str(tenants),
                                                            "--tokenizer-target", tok.target, "--models", MODEL,
                                                            "--lease-ttl-s", "2", "--metrics-port", str(metrics_port)],
                                0, logs / f"gw{i}.log", None)
            gw.metrics_port = metrics_port
            gateways.append(gw.start())
            procs.append(gw)
        for gw in gateways:
            await asyncio.to_thread(gw.wait_serving, deadline)
        worker = ScriptedWorker(redis, load_tokenizer(smollm2_path).encode(ANSWER))
        task = await worker.start()
        yield gateways, worker, redis
        task.cancel()
    finally:
        for p in procs:
            p.stop(10)
        await redis.aclose()


async def test_64_callers_3_gateways_hold_rate_and_concurrency(cluster):
    gateways, worker, _ = cluster
    channels = [grpc.aio.insecure_channel(gw.target) for gw in gateways]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in channels]
    window_s, admitted, refused = 4.0, [], {}
    start = time.monotonic()

    async def caller(i):
        stub = stubs[i % 3]
        while time.monotonic() - start < window_s:
            request = pb.GenerateRequest(prompt="hi", request_id=f"hold-{uuid.uuid4().hex}",
                                         sampling=pb.SamplingParams(max_new_tokens=2))
            try:
                await stub.Complete(request, metadata=SHARED, timeout=30)
                admitted.append(time.monotonic())
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
                limit = err.details().split(":")[1].split(";")[0].strip()
                refused[limit] = refused.get(limit, 0) + 1
                retry_ms = int(dict(err.trailing_metadata())["retry-after-ms"])
                await asyncio.sleep(min(retry_ms, 100) / 1000)

    await asyncio.gather(*(caller(i) for i in range(64)))
    elapsed = time.monotonic() - start
    for c in channels:
        await c.close()
    assert BURST <= len(admitted) <= BURST + int(RATE * elapsed) + 1      # the GCRA bound, never above
    assert 1 <= worker.peak <= MAX_CONCURRENT                             # seen by the worker side
    assert refused.get("requests_per_second", 0) > 0 and refused.get("max_concurrent", 0) > 0
    scraped = "".join(await asyncio.gather(*(asyncio.to_thread(scrape, gw.metrics_port) for gw in gateways)))
    assert 'llmserve_gateway_rejections_total{reason="requests_per_second",tenant="shared"}' in scraped
    assert 'llmserve_gateway_requests_total{code="OK",method="Complete",tenant="shared"}' in scraped
    assert "llmserve_gateway_ttft_seconds_bucket" in scraped and "llmserve_gateway_e2e_seconds_count" in scraped
    assert "shared-key" not in "".join(gw.log_path.read_text() for gw in gateways)   # keys never logged


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


async def test_leases_of_killed_gateway_expire(cluster):
    gateways, worker, redis = cluster
    victim, survivor = gateways[2], gateways[0]
    async with grpc.aio.insecure_channel(victim.target) as vch, grpc.aio.insecure_channel(survivor.target) as sch:
        held = [inference_pb2_grpc.InferenceStub(vch).Generate(
            pb.GenerateRequest(prompt="hi", request_id=f"idle-{i}", sampling=pb.SamplingParams(max_new_tokens=2)),
            metadata=CRASHY, timeout=60) for i in range(2)]
        stub = inference_pb2_grpc.InferenceStub(sch)
        deadline = time.monotonic() + 30
        while len([i for i in worker.items if i.request_id.startswith("idle-")]) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        victim.process.kill()            # kill -9: no cleanup runs
        victim.process.wait()
        request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=2))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(request, metadata=CRASHY, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in err.value.details()
        deadline = time.monotonic() + 20
        while True:                      # lease TTL is 2 s: admission comes back
            try:
                reply = await stub.Complete(request, metadata=CRASHY, timeout=30)
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                await asyncio.sleep(0.2)
        assert reply.text and reply.finish_reason == pb.FINISH_REASON_LENGTH
        for call in held:
            call.cancel()
