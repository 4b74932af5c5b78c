"""OpenTelemetry tracing of one request across every service: the one owner of setup from the
`OTEL_*` environment, W3C trace-context propagation and the span helpers the services call.

    caller ─traceparent─▶ gateway  request span (SERVER) ── admission ── tokenize ── stream
                            │ gRPC metadata   ▲ WorkItem.trace_context (the request span)
                            ▼                 │ (kept through handoff and reclaim)
                 tokenizer_svc Encode     batcher batch / reclaim,  gpu_worker queue wait,
                                          prefill, decode (gpu_worker/request_spans.py)

Off unless OTEL_TRACES_EXPORTER is `otlp` (or `console`): then every helper here returns at
once, no span object is made and the work item's trace_context stays an empty map. On, the
OTLP exporter (OTEL_EXPORTER_OTLP_PROTOCOL `grpc` or `http/protobuf`) reads its endpoint and
headers from the standard variables, and the SDK its sampler (OTEL_TRACES_SAMPLER). Spans are
batched with a short default schedule delay (OTEL_BSP_SCHEDULE_DELAY, default 500 ms here, not
the SDK's 5 s), so a process killed with -9 has already exported what it ended before.

Attribute names follow the OTel GenAI semantic conventions (`gen_ai.*`); llmserve's own are
under `llmserve.*`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmserve.runtime import clock
from llmserve.runtime.log import service_version
from llmserve.v1 import inference_pb2, queue_pb2

logger = structlog.get_logger(__name__)

# GenAI semantic-convention attribute names (https://opentelemetry.io/docs/specs/semconv/gen-ai/)
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
TOP_K = "gen_ai.request.top_k"
SEED = "gen_ai.request.seed"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
# llmserve's own
TENANT = "llmserve.tenant"
MODEL_VERSION = "llmserve.model.version"
REQUEST_ID = "llmserve.request_id"
WORKER = "llmserve.worker.id"

Attributes = Mapping[str, Any] | None
_DEFAULT_SCHEDULE_DELAY_MS = 500
_EXPORTERS = ("otlp", "console")
_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: Tracer | None = None
_provider: Any = None
# The gateway's request span of the current call (one per asyncio task, like structlog's context).
_request_span: contextvars.ContextVar[Span | None] = contextvars.ContextVar("llmserve_request_span", default=None)


class TracingConfigError(ValueError):
    """An OTEL_* variable names something this build cannot do."""


# -- setup ----------------------------------------------------------------------------------------------------
def configure(service: str) -> None:
    """Start exporting this process's spans when its environment turns tracing on. The one place
    llmserve reads OTEL_*: the SDK and the exporter read the rest of them (endpoint, headers,
    sampler, timeouts) from the same process environment, so it is read here, not passed in.

    Args:
        service: the default `service.name` (OTEL_SERVICE_NAME overrides it).
    Raises:
        TracingConfigError: an unknown exporter or protocol.
    """
    global _tracer, _provider
    environ = os.environ
    exporter_name = environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or exporter_name in ("", "none"):
        return
    if exporter_name not in _EXPORTERS:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: use one of {', '.join(_EXPORTERS)}, "
                                 f"or none")
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = environ.get("OTEL_SERVICE_NAME") or service
    resource = Resource.create({SERVICE_NAME: name, SERVICE_VERSION: service_version()})
    _provider = TracerProvider(resource=resource)   # the sampler comes from OTEL_TRACES_SAMPLER
    delay_ms = float(environ.get("OTEL_BSP_SCHEDULE_DELAY") or _DEFAULT_SCHEDULE_DELAY_MS)
    _provider.add_span_processor(BatchSpanProcessor(_exporter(exporter_name, environ),
                                                    schedule_delay_millis=delay_ms))
    _tracer = _provider.get_tracer("llmserve", service_version())
    logger.info("tracing on", exporter=exporter_name, service_name=name,
                endpoint=environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or
                environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "(default)"))


def _exporter(name: str, environ: Mapping[str, str]):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or
                environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        return HttpExporter()
    raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")


def shutdown() -> None:
    """Export what is still batched, then stop (at the end of a graceful stop)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


# -- propagation ----------------------------------------------------------------------------------------------
def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> otel_context.Context:
    """The trace context in gRPC metadata, HTTP headers or a WorkItem.trace_context map (lower-case
    `traceparent`, `tracestate`); an empty context (a new trace) when there is none."""
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def inject() -> dict[str, str]:
    """The current span's `traceparent` (and `tracestate`) to send on; {} when tracing is off."""
    carrier: dict[str, str] = {}
    if _tracer is not None:
        _PROPAGATOR.inject(carrier)
    return carrier


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the current trace to a downstream call (None when off)."""
    return tuple(inject().items()) or None


# -- generic spans --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def span(name: str, attributes: Attributes = None, kind: SpanKind = SpanKind.INTERNAL,
         parent: otel_context.Context | None = None) -> Iterator[Span | None]:
    """A span around a block, current inside it (None when off). An exception marks it ERROR."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, context=parent, kind=kind, attributes=_clean(attributes)) as s:
        yield s


def server_span(name: str, metadata: Iterable[tuple[str, str]], attributes: Attributes = None):
    """The SERVER span of an incoming gRPC call, continuing the caller's trace."""
    if _tracer is None:
        return contextlib.nullcontext()
    return span(name, attributes, SpanKind.SERVER, extract(metadata))


def start_span(name: str, attributes: Attributes = None, parent: otel_context.Context | None = None,
               start_s: float | None = None) -> Span | None:
    """A span ended by `end_span`, for a lifetime that is no `with` block (an async generator, a
    sequence in the engine); not made current. `start_s`: wall-clock start (default now). None when off."""
    if _tracer is None:
        return None
    start = None if start_s is None else _ns(start_s)
    return _tracer.start_span(name, context=parent, start_time=start, attributes=_clean(attributes))


def end_span(s: Span | None, attributes: Attributes = None, error: str = "") -> None:
    if s is None:
        return
    s.set_attributes(_clean(attributes))
    if error:
        s.set_status(Status(StatusCode.ERROR, error))
    s.end()


def record_span(name: str, parent: otel_context.Context | None, start_s: float, end_s: float,
                attributes: Attributes = None) -> None:
    """A span that already happened (wall-clock seconds), e.g. a queue wait measured from stamps."""
    if _tracer is None:
        return
    s = _tracer.start_span(name, context=parent, start_time=_ns(start_s), attributes=_clean(attributes))
    s.end(end_time=_ns(max(start_s, end_s)))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _clean(attributes: Attributes) -> dict[str, Any]:
    """Attributes without the None values (unset optional fields)."""
    return {k: v for k, v in (attributes or {}).items() if v is not None}


# -- the gateway's request span ------------------------------------------------------------------------------
def start_request(metadata: Mapping[str, str], request_id: str) -> None:
    """Open the call's SERVER span, continuing the caller's `traceparent` (gRPC metadata or HTTP
    header) or starting a trace, and make it current for the rest of the call's task (as
    structlog's request binding is). `end_request` ends it."""
    if _tracer is None:
        return
    s = _tracer.start_span("llmserve request", context=extract(metadata), kind=SpanKind.SERVER,
                           attributes={PROVIDER: "llmserve", REQUEST_ID: request_id, RESPONSE_ID: request_id})
    _request_span.set(s)
    otel_context.attach(trace.set_span_in_context(s))


def describe_request(tenant: str, request: inference_pb2.GenerateRequest) -> None:
    """GenAI request attributes of a GenerateRequest on the call's span; it is named
    `{operation} {model}` as the conventions ask."""
    s = _request_span.get()
    if s is None:
        return
    operation = operation_of(request)
    sampling = request.sampling
    s.update_name(f"{operation} {request.model}".strip())
    s.set_attributes(_clean({
        OPERATION: operation, REQUEST_MODEL: request.model or None, TENANT: tenant,
        MAX_TOKENS: sampling.max_new_tokens if sampling.HasField("max_new_tokens") else None,
        TEMPERATURE: sampling.temperature if sampling.HasField("temperature") else None,
        TOP_P: sampling.top_p if sampling.HasField("top_p") else None,
        TOP_K: sampling.top_k if sampling.HasField("top_k") else None,
        SEED: sampling.seed if sampling.HasField("seed") else None}))


def operation_of(request: inference_pb2.GenerateRequest) -> str:
    """gen_ai.operation.name of a GenerateRequest: chat for messages, text_completion for a prompt."""
    return "chat" if len(request.messages) else "text_completion"


def describe_completion(model: str, usage: inference_pb2.Usage, finish_reason: str) -> None:
    """The served model, usage and finish reason on the call's span (from the last chunk)."""
    s = _request_span.get()
    if s is None:
        return
    s.set_attributes({RESPONSE_MODEL: model, MODEL_VERSION: model_version(model),
                      INPUT_TOKENS: usage.prompt_tokens, OUTPUT_TOKENS: usage.completion_tokens,
                      FINISH_REASONS: (finish_reason,)})


def end_request(method: str, tenant: str, code: str) -> None:
    """End the call's span with its status code (an error for anything but OK)."""
    s = _request_span.get()
    if s is None:
        return
    _request_span.set(None)
    if OPERATION not in (getattr(s, "attributes", None) or {}):   # no GenerateRequest: named by its RPC
        s.update_name(method)
    s.set_attributes({"rpc.method": method, "rpc.grpc.status_code": code, TENANT: tenant})
    if code != "OK":
        s.set_status(Status(StatusCode.ERROR, code))
    s.end()


def model_version(model: str) -> str:
    """VERSION of a concrete NAME@VERSION id ("" for an id without one)."""
    return model.rpartition("@")[2] if "@" in model else ""


# -- the work item ---------------------------------------------------------------------------------------------
def item_context(item: queue_pb2.WorkItem) -> otel_context.Context | None:
    """The context a work item carries (its gateway request span); None when off."""
    if _tracer is None:
        return None
    return extract(item.trace_context)


def log_fields(item: queue_pb2.WorkItem) -> dict[str, str]:
    """`trace_id` for a log line about a work item outside its spans (batcher, worker loop); {}
    when the item carries no trace."""
    if not item.trace_context:
        return {}
    parent = trace.get_current_span(extract(item.trace_context)).get_span_context()
    return {"trace_id": trace.format_trace_id(parent.trace_id)} if parent.is_valid else {}


def item_attributes(item: queue_pb2.WorkItem, worker_id: str = "") -> dict[str, Any]:
    return _clean({REQUEST_MODEL: item.model, MODEL_VERSION: model_version(item.model), TENANT: item.tenant,
                   REQUEST_ID: item.request_id, WORKER: worker_id or None})


def record_dispatch(name: str, items: Iterable[tuple[queue_pb2.WorkItem, float]], worker_id: str,
                    attributes: Attributes = None) -> None:
    """One span per item in its own trace, from when it was picked up (wall seconds) to now: the
    batcher's batch formation, or a reclaim."""
    if _tracer is None:
        return
    now_s = clock.now_s()
    for item, since_s in items:
        record_span(name, extract(item.trace_context), since_s, now_s,
                    {**item_attributes(item, worker_id), **(attributes or {})})
