"""The Python client against a real gateway (real gRPC, real Valkey): typed
results, error mapping, and a stream that survives the gateway being replaced
mid-stream (resume by request_id, each index exactly once)."""

import asyncio

import grpc
import pytest
from gateway_harness import ANSWER, MODEL, ScriptedWorker, start_tokenizer_server
from test_gateway_service import TENANTS

from gateway.__main__ import build
from gateway.config import GatewaySettings
from llmserve.client import AsyncClient, Client, LLMServeError
from llmserve.runtime import redis_client
from llmserve.runtime.server import start_server
from tokenizer_svc.loader import load_tokenizer


class Env:
    pass


async def start_gateway(env, port):
    settings = GatewaySettings(tenants=str(env.tenants), tokenizer_target=env.tok_target, redis_url=env.redis_url,
                               models=MODEL, port=port, detach_grace_s=10.0, tokenizer_wait_s=30)
    service = build(settings)
    handle = await start_server(service, settings, settings.max_message_bytes)
    await service.start()
    await handle.set_serving(True)
    return service, handle


@pytest.fixture(scope="module")
async def env(redis_url, smollm2_path, tmp_path_factory):
    e = Env()
    e.redis_url = redis_url
    e.redis = redis_client.connect(redis_url)
    await e.redis.flushall()
    e.mt = load_tokenizer(smollm2_path)
    e.tok_server, e.tok_target = await start_tokenizer_server(e.mt)
    e.tenants = tmp_path_factory.mktemp("gwc") / "tenants.yaml"
    e.tenants.write_text(TENANTS)
    e.gateways = [await start_gateway(e, 0)]         # the kernel picks the port; a restart reuses it
    e.port = e.gateways[0][1].port
    e.worker = ScriptedWorker(e.redis, e.mt.encode(ANSWER))
    e.worker_task = await e.worker.start()
    e.target = f"127.0.0.1:{e.port}"
    yield e
    e.worker_task.cancel()
    for service, handle in e.gateways:
        await handle.server.stop(0)
        await service.close()
    await e.tok_server.stop(0)
    await e.redis.aclose()


async def test_async_client_generate_complete_tokenize_list(env):
    async with AsyncClient(env.target, api_key="acme-key") as client:
        chunks = [c async for c in client.generate("What is the capital of France?", max_new_tokens=64,
                                                    timeout=30)]
        assert "".join(c.text for c in chunks) == ANSWER
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == len(env.mt.encode(ANSWER))
        done = await client.complete(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4, timeout=30)
        assert (done.finish_reason, len(done.token_ids)) == ("length", 4)
        assert await client.tokenize("Hello world") == env.mt.encode("Hello world")
        assert [(m.id, m.context_length) for m in await client.list_models()] == [(MODEL, env.mt.context_length)]


async def test_sync_client_in_a_thread(env):
    def run():
        with Client(env.target, api_key="acme-key") as client:
            chunks = list(client.generate(prompt="Q?", max_new_tokens=64, temperature=0.0, seed=1,
                                          request_id="sync-1", timeout=30))
            with pytest.raises(LLMServeError) as err:
                client.complete(prompt="Q?", top_p=2.0, timeout=10)
            return chunks, err.value
    chunks, err = await asyncio.to_thread(run)
    assert "".join(c.text for c in chunks) == ANSWER and {c.request_id for c in chunks} == {"sync-1"}
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.details.startswith("sampling.top_p")


async def test_resource_exhausted_is_typed_with_retry_after(env):
    async with AsyncClient(env.target, api_key="tiny-key") as client:
        await client.complete("a", max_new_tokens=2, timeout=30)
        with pytest.raises(LLMServeError) as err:
            await client.complete("b", max_new_tokens=2, timeout=30)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_ms > 0


async def test_stream_survives_gateway_replacement(env):
    """Stop the gateway mid-stream, start a fresh one on the same port: the client resumes."""
    n = 30
    async with AsyncClient(env.target, api_key="acme-key") as client:
        chunks = []
        async for chunk in client.generate("tell me", max_new_tokens=n, request_id="slow-replace", timeout=120):
            chunks.append(chunk)
            if len(chunks) == 5:
                service, handle = env.gateways[-1]
                await handle.server.stop(0)
                env.gateways.append(await start_gateway(env, env.port))
    ids = [t for c in chunks for t in c.token_ids]
    assert [c.index for c in chunks] == list(range(n + 1))[:len(chunks)]     # one token per event, no repeat
    assert len(ids) == n and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks) == env.mt.decode(ids, skip_special_tokens=True)
    assert [i.request_id for i in env.worker.items].count("slow-replace") == 1
    assert "slow-replace" not in env.worker.saw_cancel


async def test_closing_the_iterator_cancels_the_request(env):
    async with AsyncClient(env.target, api_key="acme-key") as client:
        stream = client.generate("go", max_new_tokens=60, request_id="slow-abandon", timeout=60)
        assert (await stream.__anext__()).index == 0
        await stream.aclose()
    deadline = asyncio.get_running_loop().time() + 15
    while "slow-abandon" not in env.worker.saw_cancel:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_tls_with_root_cert(env, tmp_path):
    import subprocess
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    settings = GatewaySettings(tenants=str(env.tenants), tokenizer_target=env.tok_target, redis_url=env.redis_url,
                               models=MODEL, tls_cert=str(cert), tls_key=str(key), tokenizer_wait_s=30)
    service = build(settings)
    handle = await start_server(service, settings, settings.max_message_bytes)
    await service.start()
    await handle.set_serving(True)
    env.gateways.append((service, handle))
    target = f"localhost:{handle.port}"
    async with AsyncClient(target, api_key="acme-key", tls=True, root_cert=str(cert)) as client:
        assert (await client.complete("hi", max_new_tokens=4, timeout=30)).finish_reason == "length"
    async with AsyncClient(target, api_key="acme-key") as plain:   # plaintext to a TLS port fails, never hangs
        with pytest.raises(LLMServeError) as err:
            await plain.list_models(timeout=5)
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
