"""OpenAI-compatible HTTP beside gRPC, in the gateway's own event loop (Starlette on uvicorn).

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /ready

A thin front over the `Gateway` (gateway/core.py), opening each call as the gRPC front does
(gateway/calls.py: auth, deadline, x-model-version, metrics, rate-limit headers), then only
translating: JSON body ─▶ `GenerateRequest` ─▶ the same `Gateway.generate` as the gRPC
Generate/Complete (quotas, validation, shedding, tokenization, queueing, streaming: one
admission path) ─▶ OpenAI's response or SSE chunk shapes. Every failure becomes OpenAI's error
object with the HTTP status of its gRPC code (a body over the limit: 413), and is counted; a
client that disconnects mid-stream cancels the request as a gRPC cancellation does. HTTP has
no deadline of its own: each request gets --http-request-timeout-s (504 after it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import grpc
import structlog
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import choices, logprobs
from gateway.calls import code_of, count, header_id, open_call
from gateway.core import Gateway
from gateway.openai_tools import openai_tool_calls
from gateway.openai_wire import FINISH, BodyTooLarge, Parsed, parse_chat, parse_completion, parse_json, read_body
from gateway.request_state import Call
from gateway.tool_stream import ToolCallStream, stream_for
from llmserve.runtime import clock
from llmserve.runtime.errors import InvalidArgument, Unavailable
from llmserve.runtime.server import status_for
from llmserve.v1 import inference_pb2 as pb

logger = structlog.get_logger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable", 504: "timeout"}


@dataclass(frozen=True)
class HttpError:
    status: int
    body: dict
    headers: dict[str, str]


def http_error(exc: BaseException) -> HttpError:
    """OpenAI's error object for an exception the flow raised (unknown model: 404)."""
    code, message, trailing = status_for(exc)
    param = getattr(exc, "field", None)
    status = HTTP_STATUS.get(code, 500)
    if isinstance(exc, BodyTooLarge):
        status = 413
    elif isinstance(exc, InvalidArgument) and param == "model":
        status = 404
    headers = {}
    retry_ms = dict(trailing).get("retry-after-ms")
    if retry_ms is not None:
        headers["retry-after"] = str(max(1, -(-int(retry_ms) // 1000)))
        headers["retry-after-ms"] = retry_ms
    body = {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code.name.lower()}}
    return HttpError(status, body, headers)


class OpenAIHttp:
    """The HTTP app over a `Gateway`.

    Args:
        gateway: the core both fronts share (readiness follows its serving state; new
            completions are refused 503 while it drains).
        max_body_bytes: the largest request body (413 beyond it).
        timeout_s: each request's deadline.
    """

    def __init__(self, gateway: Gateway, max_body_bytes: int, timeout_s: float) -> None:
        self.gateway = gateway
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.readiness, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_exception, Exception: _unexpected})

    # -- routes ----------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "ChatCompletions", parse_chat, "chat.completion")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "Completions", parse_completion, "text_completion")

    async def models(self, request: Request) -> Response:
        call = None
        try:
            call = self._call(request)
            data = [{"id": m.id, "object": "model", "created": 0, "owned_by": "llmserve",
                     "context_length": m.context_length, **_facts(m)} for m in self.gateway.models_for(call)]
            headers = {"x-request-id": call.request_id, **dict(await self.gateway.remaining(call))}
            count("Models", call, "OK")
            return JSONResponse({"object": "list", "data": data}, headers=headers)
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI error object
            count("Models", call, _failure_code(exc))
            return _error_response(exc, call.request_id if call is not None else "-")

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(self, request: Request) -> Response:
        ready = self.gateway.serving
        return JSONResponse({"status": "serving" if ready else "not serving"}, status_code=200 if ready else 503)

    # -- one completion ----------------------------------------------------------------------------------
    def _call(self, request: Request) -> Call:
        call = open_call(self.gateway.tenants, request.headers, request.headers.get("x-request-id", ""), self.timeout_s)
        self.gateway.check_serving()       # 503 while it starts (waiting for Redis) or drains
        return call

    async def _generate(self, request: Request, method: str, parse, kind: str) -> Response:
        call = None
        try:
            call = self._call(request)
            parsed = parse(parse_json(await read_body(request, self.max_body_bytes)))
            parsed.request.request_id = call.request_id
            if parsed.user:
                logger.info("openai request", user=parsed.user, stream=parsed.stream)
            chunks = self.gateway.generate(call, parsed.request)
            tools = stream_for(parsed.request, call.request_id)
            first = await anext(chunks, None)  # admission errors become HTTP statuses, not a 200 stream
            if first is None:                    # a flow ends with a final chunk: never expected
                raise Unavailable("the request ended without output; retry")
            shape = _Shape(kind, call.request_id, call.served_model, int(clock.now_s()),
                           parsed.request.sampling.logprobs, choices.count(parsed.request))
            headers = {"x-request-id": call.request_id, **dict(call.headers)}
            if parsed.stream:
                events = self._sse(chunks, first, shape, parsed, method, call, tools)
                return EventSourceResponse(events, headers=headers, ping=15)
            reply = await choices.collect(call.request_id, _chain(first, chunks, tools))
            count(method, call, "OK")
            return JSONResponse(shape.whole(reply), headers=headers)
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI error object, never a bare 500
            count(method, call, _failure_code(exc))
            served = {"x-served-model": call.served_model} if call is not None and call.served_model else {}
            return _error_response(exc, call.request_id if call is not None else "-", served)

    async def _sse(self, chunks: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse, shape: _Shape,
                   parsed: Parsed, method: str, call: Call, tools: ToolCallStream | None) -> AsyncIterator[str]:
        code = "OK"
        try:
            for index in range(shape.n):
                yield json.dumps(shape.role_chunk(index))
            chunk: pb.GenerateResponse | None = first
            while chunk is not None:
                chunk, tool_deltas = tools.feed(chunk) if tools is not None else (chunk, [])
                if tools is None or chunk.text or tool_deltas or chunk.finish_reason:  # not a call's markup
                    yield json.dumps(shape.delta(chunk, tool_deltas))
                if chunk.HasField("usage") and parsed.include_usage:
                    yield json.dumps(shape.usage_chunk(chunk.usage))
                chunk = await anext(chunks, None)
            yield "[DONE]"
        except asyncio.CancelledError as exc:  # the client went away: counted as gRPC counts it
            code = code_of(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - after the 200 the error goes in the stream, as OpenAI does
            code = _failure_code(exc)
            yield json.dumps(http_error(exc).body)
        finally:
            count(method, call, code)


def _failure_code(exc: BaseException) -> str:
    """The status name a failure is counted under, logged as the gRPC interceptor logs it: one no
    caller can cause with its stack."""
    code, reason, _ = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("unhandled error", error=repr(exc))
    else:
        logger.info("request failed", code=code.name, reason=reason)
    return code_of(exc)


async def _chain(first: pb.GenerateResponse, rest: AsyncIterator[pb.GenerateResponse],
                 tools: ToolCallStream | None) -> AsyncIterator[pb.GenerateResponse]:
    """Every chunk of the completion, tool calls parsed out of the text when the request has tools."""
    chunk: pb.GenerateResponse | None = first
    while chunk is not None:
        yield tools.feed(chunk)[0] if tools is not None else chunk
        chunk = await anext(rest, None)


@dataclass(frozen=True)
class _Shape:
    """OpenAI's response and chunk objects of one completion."""

    kind: str            # "chat.completion" or "text_completion"
    request_id: str
    model: str
    created: int
    logprobs: bool = False           # the request asked for them
    n: int = 1                       # choices
    offsets: dict[int, int] = field(default_factory=dict)   # legacy text_offset so far, per streamed choice

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _base(self, obj: str) -> dict:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.request_id}", "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, entries) -> dict | None:
        """choice.logprobs of these tokens of choice `index` (None when the request did not ask)."""
        if not self.logprobs:
            return None
        if self.chat:
            return logprobs.chat_content(entries)
        shape, self.offsets[index] = logprobs.completion_logprobs(entries, self.offsets.get(index, 0))
        return shape

    def whole(self, reply: pb.CompleteResponse) -> dict:
        out = []
        for c in reply.choices:
            choice: dict[str, Any] = {"index": c.choice_index, "finish_reason": FINISH.get(c.finish_reason, "stop"),
                      "logprobs": self._logprobs(c.choice_index, c.logprobs)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                if c.tool_calls:
                    choice["message"].update(content=c.text or None, tool_calls=openai_tool_calls(c.tool_calls))
            else:
                choice["text"] = c.text
            out.append(choice)
        return {**self._base(self.kind), "choices": out, "usage": _usage(reply.usage)}

    def role_chunk(self, index: int = 0) -> dict:
        obj = "chat.completion.chunk" if self.chat else self.kind
        delta = {"role": "assistant", "content": ""} if self.chat else None
        choice: dict[str, Any] = {"index": index, "finish_reason": None, "logprobs": None}
        choice.update({"delta": delta} if self.chat else {"text": ""})
        return {**self._base(obj), "choices": [choice]}

    def delta(self, chunk: pb.GenerateResponse, tool_deltas: list[dict] | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else self.kind
        reason = FINISH.get(chunk.finish_reason) if chunk.finish_reason else None
        index = chunk.choice_index
        choice: dict[str, Any] = {"index": index, "finish_reason": reason,
                  "logprobs": self._logprobs(index, chunk.logprobs) if chunk.logprobs else None}
        delta: dict = {"content": chunk.text} if chunk.text or not tool_deltas else {}
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        choice.update({"delta": delta} if self.chat else {"text": chunk.text})
        return {**self._base(obj), "choices": [choice]}

    def usage_chunk(self, usage: pb.Usage) -> dict:
        obj = "chat.completion.chunk" if self.chat else self.kind
        return {**self._base(obj), "choices": [], "usage": _usage(usage)}


def _facts(model: pb.ModelInfo) -> dict:
    """A concrete model's architecture and weight format, as extra keys of its model object."""
    return {"architecture": model.architecture, "weight_format": model.weight_format} if model.architecture else {}


def _usage(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 400
    phrase = HTTPStatus(status).phrase
    body = {"error": {"message": f"{request.method} {request.url.path}: {phrase}", "type": "invalid_request_error",
                      "param": None, "code": phrase.lower().replace(" ", "_")}}
    return JSONResponse(body, status_code=status)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """The last resort for an error no handler caught: logged with its stack, still a JSON object."""
    _failure_code(exc)
    return _error_response(exc, "-")


def _error_response(exc: BaseException, request_id: str, extra: dict[str, str] | None = None) -> Response:
    error = http_error(exc)
    return JSONResponse(error.body, status_code=error.status,
                        headers={"x-request-id": header_id(request_id), **error.headers, **(extra or {})})
