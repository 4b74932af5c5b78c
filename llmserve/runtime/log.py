"""structlog JSON logging shared by every service.

Every line carries `service` and `version` (the package's). Handlers bind
`request_id`, `tenant` and `model` with `bind_request()` / `bind_model()`; structlog's
contextvars keep the binding per asyncio task, so concurrent requests never see
each other's context. While a span is current (tracing on, llmserve/runtime/tracing.py) a line
also carries its `trace_id` and `span_id`, as the exporter writes them (hex).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from importlib import metadata
from typing import Any, TextIO, cast

import structlog
from opentelemetry import trace

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of the write, not at configure time, so
    a logger cached by a module keeps working after the stream is swapped (pytest capture)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(service: str, level: str = "info") -> None:
    """JSON lines on stderr: timestamp, level, service, event and bound context."""
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=_LEVELS[level])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.EventRenamer("msg"),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, version=service_version())


def add_trace_ids(logger: object, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the current span's trace_id/span_id (none while tracing is off)."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", trace.format_trace_id(context.trace_id))
        event.setdefault("span_id", trace.format_span_id(context.span_id))
    return event


def service_version() -> str:
    """The installed llmserve package's version (every service ships in it)."""
    try:
        return metadata.version("llmserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def bind_request(request_id: str, tenant: str, model: str = "") -> None:
    """Bind request_id, tenant and model (not known yet: "") to every log line of the current task."""
    structlog.contextvars.bind_contextvars(request_id=request_id, tenant=tenant, model=model)


def bind_model(model: str) -> None:
    """Bind the concrete model id (NAME@VERSION) to every later log line of the current task."""
    structlog.contextvars.bind_contextvars(model=model)
