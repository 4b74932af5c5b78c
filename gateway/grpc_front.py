"""The public `llmserve.v1.Inference` gRPC service: a thin front over the `Gateway`.

Each handler opens the call (gateway/calls.py), asks the gateway, and answers. Every RPC
answers with initial metadata `x-request-id` (errors included); successful ones add
`x-ratelimit-remaining-requests` / `-tokens`, and Generate/Complete `x-served-model`.
Exceptions go on to the server's one interceptor (llmserve/runtime/server.py), which maps them to
exact status codes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import structlog

from gateway import choices
from gateway.bad_utf8 import Unparsable, lenient
from gateway.calls import code_of, count, header_id, open_call
from gateway.core import Gateway
from gateway.http_server import HttpServer
from gateway.request_state import Call
from gateway.tool_stream import rewrite
from llmserve.v1 import inference_pb2 as pb

logger = structlog.get_logger(__name__)

SERVICE_NAME = "llmserve.v1.Inference"


class _Headers:
    """Sends initial metadata exactly once per call, with the request id once it is known."""

    def __init__(self, context: grpc.aio.ServicerContext, request) -> None:
        self.context = context
        self.request_id = getattr(request, "request_id", "") or "-"
        self.sent = False

    async def send(self, extra: Sequence[tuple[str, str]] = ()) -> None:
        if not self.sent:
            self.sent = True
            await self.context.send_initial_metadata((("x-request-id", header_id(self.request_id)), *extra))


class InferenceService:
    """The gRPC front, and the process's lifecycle for `llmserve.runtime.server.serve` (the gateway, then
    the HTTP front when there is one).

    Args:
        gateway: the core every front shares.
        http: the OpenAI HTTP server, started after the gateway and stopped before it.
    """

    service_names = (SERVICE_NAME,)

    def __init__(self, gateway: Gateway, http: HttpServer | None = None) -> None:
        self.gateway = gateway
        self.http = http

    @property
    def failure(self) -> BaseException | None:
        """The gateway's background work died (serve() exits 1 for the supervisor to restart it)."""
        return self.gateway.failure

    # -- lifecycle -----------------------------------------------------------------------------------------
    def add_to_server(self, server: grpc.aio.Server) -> None:
        def unary(fn, req_cls, resp_cls):
            return grpc.unary_unary_rpc_method_handler(fn, lenient(req_cls), resp_cls.SerializeToString)
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(self.Generate, lenient(pb.GenerateRequest),
                                                             pb.GenerateResponse.SerializeToString),
            "Complete": unary(self.Complete, pb.GenerateRequest, pb.CompleteResponse),
            "Cancel": unary(self.Cancel, pb.CancelRequest, pb.CancelResponse),
            "Tokenize": unary(self.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
            "ListModels": unary(self.ListModels, pb.ListModelsRequest, pb.ListModelsResponse),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

    async def start(self) -> None:
        if self.http is not None:       # first: while the gateway waits for Redis, HTTP answers 503
            await self.http.start()
        await self.gateway.start()

    async def drain(self) -> None:
        await self.gateway.drain()

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.gateway.close()

    # -- per call ------------------------------------------------------------------------------------------
    def _call(self, request, context: grpc.aio.ServicerContext, headers: _Headers) -> Call:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        call = open_call(self.gateway.tenants, metadata, getattr(request, "request_id", ""), context.time_remaining())
        if isinstance(request, Unparsable):
            raise request.error
        headers.request_id = call.request_id        # errors from here on carry the real id
        return call

    async def _failed(self, method: str, headers: _Headers, exc: BaseException, call: Call | None) -> None:
        count(method, call, code_of(exc))
        served = call.served_model if call is not None else ""
        if not headers.sent and code_of(exc) != "CANCELLED":
            await headers.send([("x-served-model", served)] if served else [])

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        headers, call = _Headers(context, request), None
        try:
            call = self._call(request, context, headers)
            async for chunk in rewrite(self.gateway, call, request):
                await headers.send(call.headers)
                yield chunk
            count("Generate", call, "OK")
        except BaseException as exc:
            await self._failed("Generate", headers, exc, call)
            raise

    async def Complete(self, request, context) -> pb.CompleteResponse:
        headers, call = _Headers(context, request), None
        try:
            call = self._call(request, context, headers)
            reply = await choices.collect(call.request_id, rewrite(self.gateway, call, request))
            await headers.send(call.headers)
            count("Complete", call, "OK")
            return reply
        except BaseException as exc:
            await self._failed("Complete", headers, exc, call)
            raise

    async def _simple(self, method: str, request, context, answer: Callable[[Call], Awaitable]):
        """A unary call that does not generate: answer, then the rate-limit headers."""
        headers, call = _Headers(context, request), None
        try:
            call = self._call(request, context, headers)
            reply = await answer(call)
            await headers.send(await self.gateway.remaining(call))
            count(method, call, "OK")
            return reply
        except BaseException as exc:
            await self._failed(method, headers, exc, call)
            raise

    async def Cancel(self, request, context) -> pb.CancelResponse:
        async def answer(call: Call) -> pb.CancelResponse:
            await self.gateway.cancel(call, request.request_id)
            logger.info("cancel requested", cancelled=request.request_id)
            return pb.CancelResponse()
        return await self._simple("Cancel", request, context, answer)

    async def Tokenize(self, request, context) -> pb.TokenizeResponse:
        async def answer(call: Call) -> pb.TokenizeResponse:
            return pb.TokenizeResponse(token_ids=await self.gateway.tokenize(call, request))
        return await self._simple("Tokenize", request, context, answer)

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        async def answer(call: Call) -> pb.ListModelsResponse:
            return pb.ListModelsResponse(models=self.gateway.models_for(call))
        return await self._simple("ListModels", request, context, answer)
