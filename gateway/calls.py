"""One call through either front (gRPC or OpenAI HTTP): what both say the same way.

    ratelimit_headers   the x-ratelimit-* headers of a successful call
    rejection           the RESOURCE_EXHAUSTED of a quota refusal (counted by tenant and limit)
"""

from __future__ import annotations

from gateway import metrics
from gateway.quota import Decision
from llmserve.errors import ResourceExhausted

REMAINING_REQUESTS = "x-ratelimit-remaining-requests"
REMAINING_TOKENS = "x-ratelimit-remaining-tokens"


def ratelimit_headers(remaining_requests: int, remaining_tokens: int) -> list[tuple[str, str]]:
    return [(REMAINING_REQUESTS, str(remaining_requests)), (REMAINING_TOKENS, str(remaining_tokens))]


def rejection(tenant: str, decision: Decision, why: str = "") -> ResourceExhausted:
    """The error of a refused admission, counted in the rejections metric."""
    metrics.REJECTIONS.labels(tenant, decision.limit).inc()
    return ResourceExhausted(decision.limit, decision.retry_after_ms,
                             f"quota exceeded: {decision.limit}{why}; retry after {decision.retry_after_ms} ms")
