"""structlog JSON logging shared by every service.

Every line carries `service` and `version` (the package's). Handlers bind
`request_id`, `tenant` and `model` with `bind_request()` / `bind_model()`; structlog's
contextvars keep the binding per asyncio task, so concurrent requests never see
each other's context.
"""

from __future__ import annotations

import logging
import sys
from importlib import metadata
from typing import TextIO, cast

import structlog

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
