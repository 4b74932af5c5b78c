"""structlog JSON logging shared by every service.

Handlers bind `request_id` and `tenant` with `bind_request()`; structlog's
contextvars keep the binding per asyncio task, so concurrent requests never see
each other's context.
"""

from __future__ import annotations

import logging
import sys
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
    structlog.contextvars.bind_contextvars(service=service)


def bind_request(request_id: str, tenant: str) -> None:
    """Bind request_id and tenant to every log line of the current task."""
    structlog.contextvars.bind_contextvars(request_id=request_id, tenant=tenant)
