"""Goodput and token fairness of one load level, measured at the client.

    goodput = requests per second that finished OK within every latency target they had
              (TTFT and mean time per output token, llmserve/protocol/slo.py), per tenant and overall
    jain    = Jain's fairness index over the tenants' token throughput (prompt + output tokens
              of OK requests per second): 1.0 when equal, 1/n when one tenant got everything

    summary = summarize_goodput(results, Targets(500, 50), wall_s=12.0)
    summary["goodput_per_s"], summary["jain_tokens"], summary["by_tenant"]["0"]["met"]
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.loadgen.stats import RequestResult
from llmserve.protocol.slo import Targets, mean_tpot_ms


def met(result: RequestResult, targets: Targets) -> bool:
    """Whether a request finished OK within its targets (no targets: finishing OK is enough)."""
    if not result.ok or result.ttft_s is None:
        return False
    ttft_ms = result.ttft_s * 1000
    return targets.met(ttft_ms, mean_tpot_ms(ttft_ms, result.e2e_s * 1000, result.output_tokens))


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); None for no values or all zero."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if values and squares else None


def summarize_goodput(results: Sequence[RequestResult], targets: Targets, wall_s: float) -> dict:
    """Goodput overall and per tenant, each tenant's token throughput, and Jain's index over it."""
    per_s = 1 / wall_s if wall_s > 0 else 0.0
    tenants: dict[str, dict] = {}
    for r in results:
        t = tenants.setdefault(str(r.tenant), {"requests": 0, "met": 0, "tokens": 0})
        t["requests"] += 1
        t["met"] += met(r, targets)
        t["tokens"] += (r.prompt_tokens + r.output_tokens) if r.ok else 0
    for t in tenants.values():
        t["goodput_per_s"], t["tokens_per_s"] = t["met"] * per_s, t["tokens"] * per_s
    return {
        "targets": {"ttft_ms": targets.ttft_ms, "tpot_ms": targets.tpot_ms},
        "met": sum(t["met"] for t in tenants.values()),
        "goodput_per_s": sum(t["met"] for t in tenants.values()) * per_s,
        "jain_tokens": jain([t["tokens_per_s"] for t in tenants.values()]),
        "by_tenant": dict(sorted(tenants.items())),
    }
