"""Domain errors and the exact gRPC status code each maps to (README: "Status codes").

Services raise these; the one exception interceptor of `llmserve.runtime.server` turns
them into gRPC statuses. Anything else escaping a handler is a bug: logged with
its stack and answered INTERNAL.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base of errors a caller can cause or retry; `code` is the gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class InvalidArgument(ServiceError):
    """Bad caller input; the message names the field and why."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(ServiceError):
    """Overloaded or a dependency is down; the caller may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhausted(ServiceError):
    """A quota limit; `retry_after_ms` says when a retry can succeed."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, limit: str, retry_after_ms: int, message: str = "") -> None:
        super().__init__(message or f"quota exceeded: {limit}")
        self.limit = limit
        self.retry_after_ms = max(0, int(retry_after_ms))

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after-ms", str(self.retry_after_ms)),)
