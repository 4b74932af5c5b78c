"""The gateway's tokenizer client over a real gRPC server on a real port: a call its server
cancels (a tokenizer pod stopping mid-call, the process that held the port exiting) is made
again, at start-up and per request; a status that keeps its meaning is not."""

from __future__ import annotations

import collections

import grpc
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from gateway.tokenizer_client import TokenizerClient
from llmserve.runtime.errors import Unavailable
from llmserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc

MODEL = "tiny"


def tokenizer_json() -> str:
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


class Tokenizing(tokenizer_pb2_grpc.TokenizerServicer):
    """Answers each method after aborting its first `cancel_first` calls with `status`."""

    def __init__(self, status: grpc.StatusCode, cancel_first: int) -> None:
        self.status = status
        self.cancel_first = cancel_first
        self.calls: collections.Counter[str] = collections.Counter()
        self.tokenizer = Tokenizer.from_str(tokenizer_json())

    async def _maybe_abort(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[method] += 1
        if self.calls[method] <= self.cancel_first:
            await context.abort(self.status, "going away")

    async def GetTokenizerInfo(self, request, context):
        await self._maybe_abort("info", context)
        return tokenizer_pb2.TokenizerInfo(tokenizer_json=tokenizer_json(), eos_token_ids=[0], context_length=64)

    async def Encode(self, request, context):
        await self._maybe_abort("encode", context)
        return tokenizer_pb2.EncodeResponse(token_ids=self.tokenizer.encode(request.text).ids)


@pytest.fixture
async def serve():
    servers: list[grpc.aio.Server] = []

    async def start(servicer: Tokenizing) -> str:
        server = grpc.aio.server()
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


async def test_calls_their_server_cancels_are_made_again(serve):
    servicer = Tokenizing(grpc.StatusCode.CANCELLED, cancel_first=2)
    client = TokenizerClient([MODEL], await serve(servicer), timeout_s=2.0)
    try:
        await client.load(wait_s=30)
        assert client.get(MODEL).context_length == 64
        assert await client.encode(MODEL, "hello world", [], deadline=None) == [1, 2]
    finally:
        await client.close()
    assert servicer.calls == {"info": 3, "encode": 3}


async def test_a_status_that_keeps_its_meaning_is_not_retried(serve):
    servicer = Tokenizing(grpc.StatusCode.INVALID_ARGUMENT, cancel_first=1)
    client = TokenizerClient([MODEL], await serve(servicer), timeout_s=2.0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.load(wait_s=30)
    finally:
        await client.close()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.calls == {"info": 1}


async def test_a_server_that_keeps_cancelling_ends_in_unavailable(serve):
    servicer = Tokenizing(grpc.StatusCode.CANCELLED, cancel_first=10_000)
    client = TokenizerClient([MODEL], await serve(servicer), timeout_s=0.5)
    try:
        with pytest.raises(Unavailable):
            await client.encode(MODEL, "hello", [], deadline=None)
    finally:
        await client.close()
    assert servicer.calls["encode"] > 1
