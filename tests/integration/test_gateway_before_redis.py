"""A `python -m gateway` process started while its Redis is down waits for it: health
NOT_SERVING, gRPC UNAVAILABLE and HTTP 503 (OpenAI's error object) until a real Valkey
comes up on the URL it was given; then SERVING, and a request goes through."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from gateway_harness import MODEL, ScriptedWorker, start_tokenizer_server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.local.stack import ServiceProcess
from llmserve.local.valkey import ValkeyServer
from llmserve.runtime import redis_client
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc
from tests.conftest import TEST_TENANTS
from tokenizer_svc.loader import load_tokenizer

AUTH = (("authorization", "Bearer dev-key"),)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def waiting_gateway(smollm2_path, tmp_path):
    """A gateway process pointed at a Valkey that is not started yet (its port is chosen)."""
    model_tokenizer = load_tokenizer(smollm2_path)
    tok_server, tok_target = await start_tokenizer_server(model_tokenizer)
    valkey = ValkeyServer()
    http_port_file = tmp_path / "gateway.http.port"
    gateway = ServiceProcess("gateway", "gateway", [
        "--host", "127.0.0.1", "--redis-url", valkey.url, "--tenants", str(TEST_TENANTS), "--models", MODEL,
        "--tokenizer-target", tok_target, "--http-port", "-1", "--http-port-file", str(http_port_file),
        "--redis-wait-s", "300"], 0, tmp_path / "gateway.log", None).start()
    try:
        yield gateway, valkey, http_port_file, model_tokenizer
    finally:
        gateway.stop(10)
        valkey.close()
        await tok_server.stop(0)


async def health_status(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


async def generate(target: str, request_id: str) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(model=MODEL, prompt="Hi", request_id=request_id,
                                     sampling=pb.SamplingParams(max_new_tokens=4))
        return [r async for r in stub.Generate(request, metadata=AUTH, timeout=30)]


async def wait_file(path, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never written"
        await asyncio.sleep(0.05)
    return path.read_text().strip()


async def test_a_gateway_started_before_redis_waits_for_it(waiting_gateway):
    gateway, valkey, http_port_file, model_tokenizer = waiting_gateway
    target = f"127.0.0.1:{await asyncio.to_thread(gateway.wait_port, time.monotonic() + 120)}"
    http_url = f"http://127.0.0.1:{await wait_file(http_port_file)}"

    assert await health_status(target) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(target, "before-redis")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    async with httpx.AsyncClient(base_url=http_url, headers={"authorization": "Bearer dev-key"}) as http:
        for reply in (await http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}),
                      await http.get("/v1/models")):
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["type"] == "service_unavailable", reply.text
            assert "waiting for redis" in reply.json()["error"]["message"], reply.text
        assert (await http.get("/ready")).status_code == 503
        deadline = time.monotonic() + 60
        while "redis not reachable yet; waiting" not in gateway.log_tail(50):   # the wait says so
            assert gateway.alive() and time.monotonic() < deadline, gateway.log_tail(50)
            await asyncio.sleep(0.05)

        valkey.start()
        await asyncio.to_thread(gateway.wait_serving, time.monotonic() + 120)
        redis = redis_client.connect(valkey.url)
        worker = await ScriptedWorker(redis, model_tokenizer.encode("Paris.")).start()
        try:
            chunks = await generate(target, "after-redis")
            assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            reply = await http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            assert (await http.get("/ready")).status_code == 200
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            await redis.aclose()


async def test_sigterm_while_waiting_for_redis_stops_the_gateway(waiting_gateway):
    """The stop is not held up by the wait (300 s here): the gateway exits 0 without Redis ever up."""
    gateway, _valkey, _http_port_file, _model_tokenizer = waiting_gateway
    deadline = time.monotonic() + 120
    while "redis not reachable yet; waiting" not in gateway.log_tail(50):
        assert gateway.alive() and time.monotonic() < deadline, gateway.log_tail(50)
        await asyncio.sleep(0.05)
    assert await asyncio.to_thread(gateway.stop, 120) == 0, gateway.log_tail(50)
    assert "stopped while starting" in gateway.log_tail(50)
