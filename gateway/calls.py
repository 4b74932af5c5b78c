"""One call through either front (gRPC or OpenAI HTTP): what both do the same way.

    open_call           the caller's key → tenant, the request id bound to every log line, the
                        deadline, x-model-version (pins an alias's version), x-resume-from,
                        x-slo-ttft-ms / x-slo-tpot-ms (gateway/slo.py)
    count / code_of     the request metrics, successes and every failure alike
    ratelimit_headers   the x-ratelimit-* headers of a successful call
    rejection           the RESOURCE_EXHAUSTED of a quota refusal (counted by tenant and limit)
    header_id           a request id fit for a response header
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping

import grpc

from gateway import metrics, slo
from gateway.quota import Decision
from gateway.request_state import Call
from gateway.tenants import TenantRegistry
from gateway.validation import REQUEST_ID
from llmserve.runtime import tracing
from llmserve.runtime.errors import InvalidArgument, ResourceExhausted
from llmserve.runtime.log import bind_request
from llmserve.runtime.server import status_for

REMAINING_REQUESTS = "x-ratelimit-remaining-requests"
REMAINING_TOKENS = "x-ratelimit-remaining-tokens"
# Our own deadline fires this much before the client's, so the caller gets our DEADLINE_EXCEEDED.
_DEADLINE_MARGIN_S = 0.05
_MAX_HEADER_ID = 1024
# Calls that generate: counted per served model too (a canary's error rate beside its stable one's).
_GENERATING = frozenset({"Generate", "Complete", "ChatCompletions", "Completions"})


def open_call(tenants: TenantRegistry, metadata: Mapping[str, str], request_id: str,
              timeout_s: float | None) -> Call:
    """The `Call` of an authenticated caller (UNAUTHENTICATED otherwise).

    Args:
        tenants: the current tenants table.
        metadata: gRPC metadata or HTTP headers, lower-case names (authorization, x-model-version,
            x-resume-from).
        request_id: the caller's id, or "" for a fresh one.
        timeout_s: time left until the caller's deadline (None: no deadline).
    """
    request_id = request_id or uuid.uuid4().hex
    bind_request(request_id, "")
    tracing.start_request(metadata, request_id)   # continues the caller's traceparent; count() ends it
    tenant = tenants.authenticate(metadata)
    bind_request(request_id, tenant.id)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s - _DEADLINE_MARGIN_S
    return Call(tenant, request_id, deadline, _resume_from(metadata), model_version=_model_version(metadata),
                slo_asked=slo.from_headers(metadata))


def _model_version(metadata: Mapping[str, str]) -> str:
    """x-model-version: a version (v2) or a whole id; bounded, printable."""
    version = (metadata.get("x-model-version") or "").strip()
    if len(version) > 128 or not version.isprintable():
        raise InvalidArgument("x-model-version", "must be a model version such as v2 (at most 128 characters)")
    return version


def _resume_from(metadata: Mapping[str, str]) -> int:
    raw = metadata.get("x-resume-from", "0") or "0"
    if not raw.isdigit():
        raise InvalidArgument("x-resume-from", "must be a non-negative integer")
    return int(raw)


def code_of(exc: BaseException) -> str:
    """The status name a failure is counted under."""
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    if isinstance(exc, grpc.aio.AbortError):
        return "ABORTED"
    return status_for(exc)[0].name


def count(method: str, call: Call | None, code: str, tenant: str = "-") -> None:
    """One finished call in the request metrics (`tenant` names the caller before a Call exists)."""
    metrics.REQUESTS.labels(method, call.tenant.id if call is not None else tenant, code).inc()
    tracing.end_request(method, call.tenant.id if call is not None else tenant, code)
    if method in _GENERATING and call is not None and call.served_model:
        metrics.MODEL_REQUESTS.labels(call.served_model, code).inc()


def ratelimit_headers(remaining_requests: int, remaining_tokens: int) -> list[tuple[str, str]]:
    return [(REMAINING_REQUESTS, str(remaining_requests)), (REMAINING_TOKENS, str(remaining_tokens))]


def rejection(tenant: str, decision: Decision, why: str = "") -> ResourceExhausted:
    """The error of a refused admission, counted in the rejections metric."""
    metrics.REJECTIONS.labels(tenant, decision.limit).inc()
    return ResourceExhausted(decision.limit, decision.retry_after_ms,
                             f"quota exceeded: {decision.limit}{why}; retry after {decision.retry_after_ms} ms")


def header_id(request_id: str) -> str:
    """The id as a header value: a caller's malformed id (rejected by validation) would make gRPC
    fail the whole call with INTERNAL "invalid metadata", so it is sent as "-" instead."""
    return request_id if REQUEST_ID.fullmatch(request_id) and len(request_id) <= _MAX_HEADER_ID else "-"
