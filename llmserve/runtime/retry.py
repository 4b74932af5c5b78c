"""Retry policy: exponential backoff with full jitter, retryable errors only,
never past the caller's deadline.

    async for attempt in retrying(deadline=time.monotonic() + 5):
        with attempt:
            await stub.Encode(request, timeout=remaining(deadline))
"""

from __future__ import annotations

import asyncio
import time
from typing import overload

import grpc
import tenacity

from llmserve.runtime import redis_client
from llmserve.runtime.errors import Unavailable

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


def is_retryable(exc: BaseException) -> bool:
    """UNAVAILABLE from gRPC, our own Unavailable, and Redis connection trouble (a cluster failover too)."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code() in RETRYABLE_CODES
    return isinstance(exc, (Unavailable, *redis_client.UNAVAILABLE_ERRORS, ConnectionError))


@overload
def remaining(deadline: float, floor: float = 0.001) -> float: ...
@overload
def remaining(deadline: None, floor: float = 0.001) -> None: ...
def remaining(deadline: float | None, floor: float = 0.001) -> float | None:
    """Seconds left until a `time.monotonic()` deadline (None = no deadline)."""
    if deadline is None:
        return None
    return max(floor, deadline - time.monotonic())


class _StopAtDeadline(tenacity.stop.stop_base):
    """Stop when the next sleep would end past the deadline, or after max attempts."""

    def __init__(self, deadline: float | None, max_attempts: int) -> None:
        self.deadline = deadline
        self.max_attempts = max_attempts

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        if retry_state.attempt_number >= self.max_attempts:
            return True
        if self.deadline is None:
            return False
        upcoming = retry_state.upcoming_sleep or 0.0
        return time.monotonic() + upcoming >= self.deadline


def _policy(deadline: float | None, max_attempts: int, initial_s: float, max_backoff_s: float) -> dict:
    return dict(
        wait=tenacity.wait_random_exponential(multiplier=initial_s, max=max_backoff_s),
        stop=_StopAtDeadline(deadline, max_attempts),
        retry=tenacity.retry_if_exception(is_retryable),
        reraise=True,
    )


def retrying(deadline: float | None = None, max_attempts: int = 8, initial_s: float = 0.05,
             max_backoff_s: float = 2.0) -> tenacity.AsyncRetrying:
    """An async retry loop; the sleep before attempt n is uniform in [0, initial_s * 2**n]."""
    return tenacity.AsyncRetrying(sleep=asyncio.sleep, **_policy(deadline, max_attempts, initial_s, max_backoff_s))


def retrying_sync(deadline: float | None = None, max_attempts: int = 8, initial_s: float = 0.05,
                  max_backoff_s: float = 2.0) -> tenacity.Retrying:
    """The same policy for blocking code (the sync client)."""
    return tenacity.Retrying(**_policy(deadline, max_attempts, initial_s, max_backoff_s))
