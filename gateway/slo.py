"""A request's latency targets at the gateway: where they come from, and whether they were met.

    targets   GenerateRequest.slo_ttft_ms / slo_tpot_ms  >  metadata / HTTP headers
              x-slo-ttft-ms / x-slo-tpot-ms  >  the tenant's slo_ttft_ms / slo_tpot_ms
              (0 = no target; each target resolved on its own)
    goodput   every finished request is counted per tenant and priority as `met` (within every
              target it has; one with none meets them by finishing) or `missed`; a request refused
              early because it could not meet its TTFT (gateway/shedding.py) counts as `refused`

The next-token deadline the batcher and worker order by is llmserve/protocol/slo.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter

from gateway.tenants import MAX_SLO_MS, Tenant
from llmserve.protocol import keys
from llmserve.protocol.slo import Targets, mean_tpot_ms
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from gateway.request_clock import Watch
    from gateway.slo_estimate import ServiceEstimate

HEADERS = ("x-slo-ttft-ms", "x-slo-tpot-ms")

SLO_REQUESTS = Counter("llmserve_gateway_slo_requests_total",
                       "finished requests by tenant, priority and result: met (within every latency target), "
                       "missed, or refused (early, as unmeetable); goodput = rate of result=met",
                       ["tenant", "priority", "result"])
TENANT_TOKENS = Counter("llmserve_gateway_tenant_tokens_total",
                        "prompt + completion tokens of finished requests by tenant (token fairness)", ["tenant"])


@dataclass(frozen=True)
class Asked:
    """Targets a caller gave in one place (fields or headers); None = not given there."""

    ttft_ms: int | None = None
    tpot_ms: int | None = None


def _in_range(name: str, value: int) -> int:
    if not 0 <= value <= MAX_SLO_MS:
        raise InvalidArgument(name, f"must be 0..{MAX_SLO_MS} ms (0 = no target)")
    return value


def _header(metadata: Mapping[str, str], name: str) -> int | None:
    raw = (metadata.get(name) or "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise InvalidArgument(name, f"must be an integer number of ms 0..{MAX_SLO_MS}")
    return _in_range(name, int(raw))


def from_headers(metadata: Mapping[str, str]) -> Asked:
    """The x-slo-* headers (gRPC metadata or HTTP); INVALID_ARGUMENT naming the header when malformed."""
    return Asked(_header(metadata, HEADERS[0]), _header(metadata, HEADERS[1]))


def from_request(request: pb.GenerateRequest) -> Asked:
    """The request's own slo_* fields, range-checked (INVALID_ARGUMENT naming the field)."""
    ttft = _in_range("slo_ttft_ms", request.slo_ttft_ms) if request.HasField("slo_ttft_ms") else None
    tpot = _in_range("slo_tpot_ms", request.slo_tpot_ms) if request.HasField("slo_tpot_ms") else None
    return Asked(ttft, tpot)


def resolve(fields: Asked, headers: Asked, tenant: Tenant) -> Targets:
    """Each target from the first place that gives it: fields, headers, the tenant's default."""
    ttft = next(v for v in (fields.ttft_ms, headers.ttft_ms, tenant.slo.ttft_ms) if v is not None)
    tpot = next(v for v in (fields.tpot_ms, headers.tpot_ms, tenant.slo.tpot_ms) if v is not None)
    return Targets(ttft, tpot)


def count_refused(tenant: str, priority: int) -> None:
    SLO_REQUESTS.labels(tenant, keys.priority_name(priority), "refused").inc()


def count_finished(tenant: str, priority: int, targets: Targets, usage: pb.Usage) -> bool:
    """Count a finished request in the goodput series; returns whether it met its targets."""
    tpot = mean_tpot_ms(usage.ttft_ms, usage.total_ms, usage.completion_tokens)
    met = targets.met(usage.ttft_ms, tpot)
    SLO_REQUESTS.labels(tenant, keys.priority_name(priority), "met" if met else "missed").inc()
    TENANT_TOKENS.labels(tenant).inc(usage.prompt_tokens + usage.completion_tokens)
    return met


@dataclass(frozen=True)
class Admitted:
    """What the stream needs of a newly submitted request's SLO: its targets, priority, and how
    many requests were queued ahead of it at submit (the shedder's queue-rate measure)."""

    targets: Targets
    priority: int
    ahead: int


class StreamSlo:
    """The SLO side of one stream: its first token feeds the shedder's estimate, its last chunk
    the goodput count. A resumed viewer (no `Admitted`) counts nothing: the first one did."""

    def __init__(self, estimate: ServiceEstimate, admitted: Admitted | None, tenant: str, model: str,
                 enqueued_ms: int) -> None:
        self.estimate = estimate
        self.admitted = admitted
        self.tenant, self.model, self.enqueued_ms = tenant, model, enqueued_ms
        self.started = False

    def chunk(self, chunk: pb.GenerateResponse, watch: Watch) -> None:
        if self.admitted is None:
            return
        first = watch.first_event
        if not self.started and chunk.token_ids and first is not None and first.admitted_unix_ms \
                and watch.first_token_ms is not None:
            self.started = True
            self.estimate.started(self.model, self.admitted.priority, self.admitted.ahead,
                                  first.admitted_unix_ms - self.enqueued_ms,
                                  watch.first_token_ms - first.admitted_unix_ms,
                                  first.prompt_tokens - first.cached_prompt_tokens,
                                  self.admitted.targets.ttft_ms)
        if chunk.HasField("usage") and chunk.finish_reason != pb.FINISH_REASON_CANCELLED:
            count_finished(self.tenant, self.admitted.priority, self.admitted.targets, chunk.usage)
