"""The exception interceptor maps domain errors to exact gRPC codes on a real server."""

import grpc
import pytest
import redis.exceptions
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.runtime import errors
from llmserve.runtime.server import start_server
from llmserve.runtime.settings import CommonSettings

RAISERS = {
    b"invalid": lambda: errors.InvalidArgument("sampling.top_p", "must be in (0, 1]"),
    b"unauth": lambda: errors.Unauthenticated("unknown api key"),
    b"denied": lambda: errors.PermissionDenied("model not allowed"),
    b"notfound": lambda: errors.NotFound("unknown request id"),
    b"unavailable": lambda: errors.Unavailable("overloaded"),
    b"deadline": lambda: errors.DeadlineExceeded("deadline exceeded"),
    b"quota": lambda: errors.ResourceExhausted("requests_per_second", 250),
    b"redis": lambda: redis.exceptions.ConnectionError("connection refused"),
    b"bug": lambda: ZeroDivisionError("oops"),
}


class RaisingService:
    service_names = ("test.Errors",)

    async def unary(self, request: bytes, context):
        raise RAISERS[request]()

    async def stream(self, request: bytes, context):
        yield b"first"
        raise RAISERS[request]()

    def add_to_server(self, server):
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Errors", handlers),))

    async def start(self): ...
    async def drain(self): ...
    async def close(self): ...


@pytest.fixture
async def target():
    handle = await start_server(RaisingService(), CommonSettings())
    await handle.set_serving(True)
    yield f"127.0.0.1:{handle.port}"
    await handle.server.stop(0)


async def test_service_rpcs_are_unavailable_until_started_but_health_answers():
    handle = await start_server(RaisingService(), CommonSettings())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="test.Errors"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/test.Errors/Unary")(b"invalid", timeout=5)
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, "starting")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in channel.unary_stream("/test.Errors/Stream")(b"invalid", timeout=5):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await handle.set_serving(True)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/test.Errors/Unary")(b"invalid", timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await handle.server.stop(0)


EXPECTED = [
    (b"invalid", grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]"),
    (b"unauth", grpc.StatusCode.UNAUTHENTICATED, "unknown api key"),
    (b"denied", grpc.StatusCode.PERMISSION_DENIED, "model not allowed"),
    (b"notfound", grpc.StatusCode.NOT_FOUND, "unknown request id"),
    (b"unavailable", grpc.StatusCode.UNAVAILABLE, "overloaded"),
    (b"deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"),
    (b"quota", grpc.StatusCode.RESOURCE_EXHAUSTED, "quota exceeded: requests_per_second"),
    (b"redis", grpc.StatusCode.UNAVAILABLE, "redis unavailable"),
    (b"bug", grpc.StatusCode.INTERNAL, "internal error"),
]


@pytest.mark.parametrize("kind, code, details", EXPECTED)
async def test_unary_codes(target, kind, code, details):
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/test.Errors/Unary")(kind, timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
    assert err.value.code() == code
    assert err.value.details() == details


@pytest.mark.parametrize("kind, code, details", EXPECTED)
async def test_stream_codes_after_first_message(target, kind, code, details):
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_stream("/test.Errors/Stream")(kind, timeout=5)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for item in call:
                received.append(item)
    assert received == [b"first"]
    assert err.value.code() == code


async def test_quota_carries_retry_after(target):
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/test.Errors/Unary")(b"quota", timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
    assert ("retry-after-ms", "250") in tuple(err.value.trailing_metadata())
