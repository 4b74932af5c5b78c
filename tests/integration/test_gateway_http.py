"""The OpenAI HTTP front of a gateway over real HTTPS and a Valkey of its own (so it can be
killed), with a real tokenizer server and a scripted worker (tests/integration/gateway_harness.py):
every failure is OpenAI's JSON error object with its status and is counted, the body limit holds
while the body is read, a drain answers 503, and a rotated certificate is served at the next
handshake. The outages run last: the tokenizer server, then Valkey, is stopped."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import ssl

import httpx2 as httpx
import pytest
from gateway_harness import ANSWER, ScriptedWorker, start_tokenizer_server
from prometheus_client import REGISTRY
from test_gateway_service import TENANTS
from test_server_transport import make_cert

from gateway.__main__ import build
from gateway.config import GatewaySettings
from llmserve.local.valkey import ValkeyServer
from llmserve.runtime import redis_client
from llmserve.runtime.server import start_server
from tokenizer_svc.loader import load_tokenizer

BODY_LIMIT = 512 * 1024
HTTP_TIMEOUT_S = 3.0
AUTH = {"authorization": "Bearer acme-key"}
HI = [{"role": "user", "content": "Hi"}]


class Env:
    pass


@pytest.fixture(scope="module")
async def env(smollm2_path, tmp_path_factory):
    e = Env()
    e.dir = tmp_path_factory.mktemp("gw-http")
    e.valkey = ValkeyServer().start()
    e.redis = redis_client.connect(e.valkey.url)
    e.model_tokenizer = load_tokenizer(smollm2_path)
    e.tok_server, tok_target = await start_tokenizer_server(e.model_tokenizer)
    e.old_cert, e.old_key = make_cert(e.dir, "old")
    e.new_cert, e.new_key = make_cert(e.dir, "new")
    e.live_cert, e.live_key = e.dir / "tls.crt", e.dir / "tls.key"
    shutil.copy(e.old_cert, e.live_cert)
    shutil.copy(e.old_key, e.live_key)
    tenants = e.dir / "tenants.yaml"
    tenants.write_text(TENANTS)
    e.settings = GatewaySettings(tenants=str(tenants), tokenizer_target=tok_target, redis_url=e.valkey.url,
                                 models="smollm2-135m", http_port=-1, max_prompt_bytes=1000,
                                 max_http_body_bytes=BODY_LIMIT, tokenizer_timeout_s=1.0, tokenizer_wait_s=30,
                                 http_request_timeout_s=HTTP_TIMEOUT_S,
                                 tls_cert=str(e.live_cert), tls_key=str(e.live_key))
    e.service = build(e.settings)
    e.handle = await start_server(e.service, e.settings, e.settings.max_message_bytes)
    await e.service.start()
    await e.handle.set_serving(True)
    e.url = f"https://localhost:{e.service.http.port}"
    e.worker = ScriptedWorker(e.redis, e.model_tokenizer.encode(ANSWER))
    e.worker_task = await e.worker.start()
    e.http = client(e, e.old_cert)
    yield e
    await e.http.aclose()
    e.worker_task.cancel()
    await e.handle.server.stop(0)
    await e.service.close()
    await e.tok_server.stop(0)
    await e.redis.aclose()
    e.valkey.close()
    # The outages leave failed tasks and dropped connections behind: collect them here. On CPython
    # 3.11.7 a garbage collection that runs their finalizers in the middle of an ast.parse (pytest's
    # next assertion rewrite) fails it with a spurious "AST constructor recursion depth mismatch".
    gc.collect()


def client(env, trusted_cert) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=env.url, headers=AUTH, timeout=30,
                             verify=ssl.create_default_context(cafile=str(trusted_cert)))


def failures(code: str, tenant: str = "acme") -> float:
    value = REGISTRY.get_sample_value("llmserve_gateway_requests_total",
                                      {"method": "ChatCompletions", "tenant": tenant, "code": code})
    return value or 0.0


def assert_openai_error(reply: httpx.Response, status: int, param: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_BODIES = [
    ("100k nested brackets", b"[" * 100_000 + b"]" * 100_000, "body"),
    ("nested objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "body"),
    ("bad utf-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "body"),
    ("not json", b"model=smollm2&prompt=hi", "body"),
    ("not an object", b'["messages"]', "body"),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("max_tokens beyond uint32", json.dumps({"messages": HI, "max_tokens": 2**40}).encode(), "max_tokens"),
    ("seed beyond uint64", json.dumps({"messages": HI, "seed": 2**70}).encode(), "seed"),
    ("temperature a string", json.dumps({"messages": HI, "temperature": "hot"}).encode(), "temperature"),
    ("messages an object", json.dumps({"messages": {"role": "user"}}).encode(), "messages"),
    ("stop a number", json.dumps({"messages": HI, "stop": 3}).encode(), "stop"),
]


@pytest.mark.parametrize("name, body, param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
async def test_bad_bodies_are_400_json_errors_and_counted(env, name, body, param):
    before = failures("INVALID_ARGUMENT")
    reply = await env.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(reply, 400, param)
    assert reply.headers["x-request-id"]
    assert failures("INVALID_ARGUMENT") == before + 1


async def test_a_body_over_the_limit_is_413_and_counted(env):
    before = failures("INVALID_ARGUMENT")
    big = json.dumps({"messages": HI, "padding": "x" * (2 * BODY_LIMIT)}).encode()
    assert_openai_error(await env.http.post("/v1/chat/completions", content=big), 413, "body")

    async def chunked():              # no content-length: the limit is found while reading
        for _ in range(3):
            yield b" " * BODY_LIMIT
    assert_openai_error(await env.http.post("/v1/chat/completions", content=chunked()), 413, "body")
    assert failures("INVALID_ARGUMENT") == before + 2


async def test_a_huge_declared_body_is_refused_before_any_of_it_is_read(env):
    """Content-Length 1 GiB and not one body byte sent: the 413 still comes back."""
    context = ssl.create_default_context(cafile=str(env.old_cert))
    reader, writer = await asyncio.open_connection("localhost", env.service.http.port, ssl=context)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer acme-key\r\n"
                 b"content-type: application/json\r\ncontent-length: 1073741824\r\n\r\n")
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    assert status_line.split()[1] == b"413", status_line


async def test_body_is_read_only_after_authentication(env):
    reply = await env.http.post("/v1/chat/completions", content=b"[" * 100_000, headers={"authorization": "Bearer nope"})
    assert_openai_error(reply, 401)


async def test_unknown_routes_and_methods_are_json_errors(env):
    assert_openai_error(await env.http.get("/v1/nothing"), 404)
    assert_openai_error(await env.http.delete("/v1/models"), 405)


async def test_http_opens_its_calls_as_grpc_does(env):
    """The same per-call opening as gRPC: x-model-version is checked and pins, the rate-limit
    headers come on every success, and a request has a deadline (504 once it passes)."""
    body = {"messages": HI, "max_tokens": 2}
    assert_openai_error(await env.http.post("/v1/chat/completions", json=body, headers={"x-model-version": "v" * 200}),
                        400, "x-model-version")
    assert_openai_error(await env.http.post("/v1/chat/completions", json=body, headers={"x-model-version": "v9"}), 404)
    models = await env.http.get("/v1/models")
    assert int(models.headers["x-ratelimit-remaining-requests"]) > 0 and "x-ratelimit-remaining-tokens" in models.headers
    before = failures("DEADLINE_EXCEEDED")
    never_dispatched = await env.http.post("/v1/chat/completions", json=body, headers={"x-request-id": "idle-http-1"})
    assert assert_openai_error(never_dispatched, 504)["type"] == "timeout"
    assert failures("DEADLINE_EXCEEDED") == before + 1


async def test_a_rotated_certificate_is_served_at_the_next_handshake(env):
    async with client(env, env.old_cert) as old:
        assert (await old.get("/v1/models")).status_code == 200
    for src, dst in ((env.new_cert, env.live_cert), (env.new_key, env.live_key)):
        shutil.copy(src, f"{dst}.tmp")
        shutil.move(f"{dst}.tmp", dst)
    async with client(env, env.new_cert) as new:
        assert (await new.get("/v1/models")).status_code == 200
    async with client(env, env.old_cert) as old:
        with pytest.raises(httpx.ConnectError):
            await old.get("/v1/models")
    await env.http.aclose()
    env.http = client(env, env.new_cert)


async def test_a_draining_gateway_answers_503(env):
    await env.service.drain()
    try:
        reply = await env.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert assert_openai_error(reply, 503)["type"] == "service_unavailable"
    finally:
        env.service.gateway.serving = True
    reply = await env.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


async def test_a_redis_outage_is_503_for_completions_and_streams_and_passes(env):
    env.worker_task.cancel()
    await asyncio.gather(env.worker_task, return_exceptions=True)
    env.valkey.stop(kill=True)
    before = failures("UNAVAILABLE")
    for body in ({"messages": HI, "max_tokens": 2}, {"messages": HI, "max_tokens": 2, "stream": True}):
        reply = await env.http.post("/v1/chat/completions", json=body)
        assert assert_openai_error(reply, 503)["message"] == "redis unavailable"
    assert failures("UNAVAILABLE") == before + 2
    assert (await env.http.get("/health")).status_code == 200
    env.valkey.start()
    env.worker_task = await env.worker.start()
    for _ in range(5):    # a pooled connection from before the outage may fail once more: 503, retryable
        reply = await env.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        if reply.status_code != 503:
            break
    assert reply.status_code == 200, reply.text


async def test_a_tokenizer_outage_is_503(env):
    await env.tok_server.stop(0)
    queued = len(env.worker.items)
    before = failures("UNAVAILABLE")
    reply = await env.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hey"}],
                                                              "max_tokens": 2})
    assert_openai_error(reply, 503)
    assert failures("UNAVAILABLE") == before + 1
    assert len(env.worker.items) == queued
