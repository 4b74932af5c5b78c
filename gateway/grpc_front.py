"""The public `llmserve.v1.Inference` service: auth, then the request flow.

Every RPC answers with initial metadata `x-request-id` (errors included);
successful ones add `x-ratelimit-remaining-requests` / `-tokens`.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog

from gateway import metrics
from gateway.config import GatewaySettings
from gateway.flow import Flow, limits_of
from gateway.http_server import HttpServer
from gateway.models import ModelCatalog
from gateway.openai_http import OpenAIHttp
from gateway.quota import Quota
from gateway.request_state import Call
from gateway.response_format import FormatCompiler
from gateway.routing import Router
from gateway.tenants import TenantRegistry
from gateway.validation import REQUEST_ID, check_input
from gateway.wire import Unparsable, lenient
from llmserve import redis_client
from llmserve.errors import InvalidArgument, ResourceExhausted
from llmserve.log import bind_request
from llmserve.server import status_for, write_port_file
from llmserve.v1 import inference_pb2 as pb

logger = structlog.get_logger(__name__)

SERVICE_NAME = "llmserve.v1.Inference"
# Our own deadline fires this much before the client's, so the caller gets our DEADLINE_EXCEEDED.
_DEADLINE_MARGIN_S = 0.05


def _code_name(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    if isinstance(exc, grpc.aio.AbortError):
        return "ABORTED"
    return status_for(exc)[0].name


_MAX_HEADER_ID = 1024


class _Headers:
    """Sends initial metadata exactly once per call."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.sent = False

    async def send(self, request_id: str, extra: list[tuple[str, str]] = ()) -> None:
        if not self.sent:
            self.sent = True
            await self.context.send_initial_metadata((("x-request-id", _printable_id(request_id)), *extra))


class InferenceService:
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.tenants = TenantRegistry(settings.tenants).load()
        self.redis = redis_client.connect(settings.redis_url, settings.redis_password)
        self.blocking = redis_client.connect(settings.redis_url, settings.redis_password, socket_timeout=10.0,
                                             max_connections=settings.max_streams)
        self.models = settings.models_config()
        self.catalog = ModelCatalog(self.models.ids, settings.tokenizer_target, settings.tokenizer_timeout_s)
        self.router = Router(self.models, self.redis, settings.route_refresh_ms / 1000, settings.worker_heartbeat_ttl_ms,
                             settings.queue_shards)
        self.quota = Quota(self.redis, settings.lease_ttl_s, settings.concurrency_retry_ms)
        self.formats = FormatCompiler(settings.grammar_compile_timeout_s, settings.grammar_threads)
        self.flow = Flow(settings, self.redis, self.blocking, self.catalog, self.quota, self.router, self.formats)
        self.serving = False
        self.http: HttpServer | None = None

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
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.tenants.reload)
        await self.redis.ping()
        await self.catalog.load(self.settings.tokenizer_wait_s)
        await self.router.start()
        if self.settings.http_port:
            await self._start_http()
        self.serving = True

    async def _start_http(self) -> None:
        """The OpenAI-compatible endpoint, bound before it is reported (as the gRPC port is)."""
        self.http = HttpServer(OpenAIHttp(self, lambda: self.serving, self.settings.max_http_body_bytes).app, self.settings.host,
                               self.settings.http_port, self.settings.tls_cert, self.settings.tls_key)
        await self.http.start()
        if self.settings.http_port_file:
            write_port_file(self.settings.http_port_file, self.http.port)

    async def drain(self) -> None:
        """In-flight streams go on until the server's grace ends; cleanups finish first."""
        self.serving = False

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.flow.drain()
        await self.router.close()
        await self.catalog.close()
        await self.redis.aclose()
        await self.blocking.aclose()
        self.formats.close()

    # -- per call ------------------------------------------------------------------------------------------
    def _call(self, request, context: grpc.aio.ServicerContext) -> Call:
        request_id = getattr(request, "request_id", "") or uuid.uuid4().hex
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        bind_request(request_id, "")
        tenant = self.tenants.authenticate(metadata)
        bind_request(request_id, tenant.id)
        if isinstance(request, Unparsable):
            raise request.error
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining - _DEADLINE_MARGIN_S
        return Call(tenant, request_id, deadline, _resume_from(metadata),
                    model_version=_model_version(metadata))

    async def _failed(self, method: str, request, headers: _Headers, tenant: str, exc: BaseException,
                      call: Call | None = None) -> None:
        code = _code_name(exc)
        metrics.REQUESTS.labels(method, tenant, code).inc()
        served = call.served_model if call is not None else ""
        if served:
            metrics.MODEL_REQUESTS.labels(served, code).inc()
        if not headers.sent and not isinstance(exc, asyncio.CancelledError):
            await headers.send(getattr(request, "request_id", "") or "-", [("x-served-model", served)] if served else [])

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        headers, tenant, call = _Headers(context), "-", None
        try:
            call = self._call(request, context)
            tenant = call.tenant.id
            headers = _RequestHeaders(context, call.request_id)
            async for chunk in self.flow.generate(call, request):
                await headers.send(call.request_id, call.headers)
                yield chunk
            _succeeded("Generate", call)
        except BaseException as exc:
            await self._failed("Generate", request, headers, tenant, exc, call)
            raise

    async def Complete(self, request, context) -> pb.CompleteResponse:
        headers, tenant, call = _Headers(context), "-", None
        try:
            call = self._call(request, context)
            tenant = call.tenant.id
            headers = _RequestHeaders(context, call.request_id)
            reply = pb.CompleteResponse(request_id=call.request_id)
            texts = []
            async for chunk in self.flow.generate(call, request):
                texts.append(chunk.text)
                reply.token_ids.extend(chunk.token_ids)
                reply.finish_reason = chunk.finish_reason
                if chunk.HasField("usage"):
                    reply.usage.CopyFrom(chunk.usage)
            reply.text = "".join(texts)
            await headers.send(call.request_id, call.headers)
            _succeeded("Complete", call)
            return reply
        except BaseException as exc:
            await self._failed("Complete", request, headers, tenant, exc, call)
            raise

    async def _simple(self, method: str, request, context, body):
        headers, tenant = _Headers(context), "-"
        try:
            call = self._call(request, context)
            tenant = call.tenant.id
            reply = await body(call, request)
            rem_req, rem_tok = await self.quota.peek(limits_of(call.tenant))
            await headers.send(call.request_id, [("x-ratelimit-remaining-requests", str(rem_req)),
                                                 ("x-ratelimit-remaining-tokens", str(rem_tok))])
            metrics.REQUESTS.labels(method, tenant, "OK").inc()
            return reply
        except BaseException as exc:
            await self._failed(method, request, headers, tenant, exc)
            raise

    async def Cancel(self, request, context) -> pb.CancelResponse:
        return await self._simple("Cancel", request, context, self._cancel)

    async def Tokenize(self, request, context) -> pb.TokenizeResponse:
        return await self._simple("Tokenize", request, context, self._tokenize)

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        return await self._simple("ListModels", request, context, self._list_models)

    async def _cancel(self, call: Call, request: pb.CancelRequest) -> pb.CancelResponse:
        if not request.request_id:
            raise InvalidArgument("request_id", "required")
        await self.flow.cancel_owned(call.tenant.id, request.request_id)
        logger.info("cancel requested", cancelled=request.request_id)
        return pb.CancelResponse()

    async def _tokenize(self, call: Call, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        model = self.flow.model_for(call, request)
        check_input(request.text, request.messages, self.flow.limits, prompt_field="text")
        await self._charge_request(call)
        ids = await self.catalog.encode(model.id, request.text, request.messages, call.deadline,
                                        call.tenant.raw_special_tokens)
        return pb.TokenizeResponse(token_ids=ids)

    async def _charge_request(self, call: Call) -> None:
        """A call that uses the shared tokenizer pool counts against the tenant's request rate."""
        decision = await self.quota.charge_request(limits_of(call.tenant))
        if not decision.admitted:
            metrics.REJECTIONS.labels(call.tenant.id, decision.limit).inc()
            raise ResourceExhausted(decision.limit, decision.retry_after_ms,
                                    f"quota exceeded: {decision.limit}; retry after {decision.retry_after_ms} ms")

    async def _list_models(self, call: Call, request: pb.ListModelsRequest) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[m for m in self.model_infos() if call.tenant.may_use(m.id)])

    def model_infos(self) -> list[pb.ModelInfo]:
        """Concrete models, then aliases with their current weights; the default one marked."""
        default = self.models.default_name
        concrete = self.catalog.list()
        for info in concrete:
            info.kind, info.is_default = pb.MODEL_KIND_CONCRETE, info.id == default
        aliases = [pb.ModelInfo(id=alias, kind=pb.MODEL_KIND_ALIAS, is_default=alias == default,
                                context_length=min(self.catalog.context_length(m) for m in weights),
                                routes=[pb.RouteWeight(model=m, weight=w) for m, w in sorted(weights.items())])
                   for alias, weights in self.router.aliases().items()]
        return concrete + aliases


class _RequestHeaders(_Headers):
    """Headers of a call whose request_id is known (errors then carry the real id)."""

    def __init__(self, context: grpc.aio.ServicerContext, request_id: str) -> None:
        super().__init__(context)
        self.request_id = request_id

    async def send(self, request_id: str, extra: list[tuple[str, str]] = ()) -> None:
        await super().send(self.request_id, extra)


def _printable_id(request_id: str) -> str:
    """The id as a header value: a caller's malformed id (rejected by validation) would make gRPC
    fail the whole call with INTERNAL "invalid metadata", so it is sent as "-" instead."""
    return request_id if REQUEST_ID.fullmatch(request_id) and len(request_id) <= _MAX_HEADER_ID else "-"


def _succeeded(method: str, call: Call) -> None:
    metrics.REQUESTS.labels(method, call.tenant.id, "OK").inc()
    metrics.MODEL_REQUESTS.labels(call.served_model, "OK").inc()


def _model_version(metadata: dict[str, str]) -> str:
    """Metadata x-model-version: a version (v2) or a whole id; bounded, printable."""
    version = (metadata.get("x-model-version") or "").strip()
    if len(version) > 128 or not version.isprintable():
        raise InvalidArgument("x-model-version", "must be a model version such as v2 (at most 128 characters)")
    return version


def _resume_from(metadata: dict[str, str]) -> int:
    raw = metadata.get("x-resume-from", "0") or "0"
    if not raw.isdigit():
        raise InvalidArgument("x-resume-from", "must be a non-negative integer")
    return int(raw)
