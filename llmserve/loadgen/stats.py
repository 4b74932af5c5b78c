"""Per-request measurements and the summary of one load level.

    result = RequestResult(tenant=0, code="OK", start_s=0.0, first_token_s=0.12, end_s=0.9,
                           chunk_times_s=[0.12, 0.2], chunk_tokens=[1, 1])
    summary = summarize([result, ...], wall_s=12.0)
    summary["ttft_s"]["p99"], summary["throughput"]["output_tokens_per_s"]
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one request did. Times are seconds on the runner's monotonic clock."""

    tenant: int
    code: str                               # grpc status name: "OK", "UNAVAILABLE", ...
    start_s: float
    end_s: float
    first_token_s: float | None = None      # arrival of the first message carrying tokens
    chunk_times_s: list[float] = field(default_factory=list)   # arrival of each message with tokens
    chunk_tokens: list[int] = field(default_factory=list)      # tokens in each such message
    prompt_tokens: int = 0
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    def inter_token_s(self) -> list[float]:
        """One latency per token after the first: a message of k tokens arriving dt after the
        previous one contributes k samples of dt/k (tokens that arrive together share the gap)."""
        samples: list[float] = []
        for i in range(1, len(self.chunk_times_s)):
            k = self.chunk_tokens[i]
            if k > 0:
                samples.extend([(self.chunk_times_s[i] - self.chunk_times_s[i - 1]) / k] * k)
        # Tokens beyond the first that came in the first message arrived with no gap.
        first_extra = (self.chunk_tokens[0] - 1) if self.chunk_tokens else 0
        return [0.0] * max(first_extra, 0) + samples


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean and p50/p90/p99 of a sample."""
    out: dict[str, float | int | None] = {"count": len(values),
                                          "mean": (sum(values) / len(values)) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict:
    """Latency distributions (successful requests only), throughput and error counts."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [s for r in ok for s in r.inter_token_s()]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "codes": dict(sorted(Counter(r.code for r in results).items())),
        "wall_s": wall_s,
        "ttft_s": distribution(ttft),
        "inter_token_s": distribution(itl),
        "e2e_s": distribution([r.e2e_s for r in ok]),
        "throughput": {
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
            "output_tokens": output_tokens,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
        },
        "by_tenant": _by_tenant(results),
    }


def _by_tenant(results: Sequence[RequestResult]) -> dict[str, dict[str, int]]:
    tenants: dict[str, Counter] = {}
    for r in results:
        tenants.setdefault(str(r.tenant), Counter())[r.code] += 1
    return {t: dict(sorted(c.items())) for t, c in sorted(tenants.items())}
