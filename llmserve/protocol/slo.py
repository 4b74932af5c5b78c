"""Latency targets (SLOs) of a request: the one definition gateway, batcher and worker share.

A request may carry a time-to-first-token target and a time-per-output-token target
(`GenerateRequest.slo_ttft_ms` / `slo_tpot_ms`, headers `x-slo-ttft-ms` / `x-slo-tpot-ms`,
else its tenant's defaults; 0 = none). Its next token is due at

    arrival + ttft + generated * tpot          (unix ms; the first token: generated = 0)

which is what "earliest deadline first" orders by, in the batcher's queue and in the worker's
waiting queue, within one priority. A request with no TTFT target has no deadline.
A finished request met its targets when its TTFT and its mean TPOT were within them (goodput).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.v1 import queue_pb2

NO_DEADLINE = float("inf")


@dataclass(frozen=True)
class Targets:
    """A request's latency targets in ms; 0 = none."""

    ttft_ms: int = 0
    tpot_ms: int = 0

    @property
    def any(self) -> bool:
        return bool(self.ttft_ms or self.tpot_ms)

    def met(self, ttft_ms: float, tpot_ms: float) -> bool:
        """Whether a request with these timings met every target it has."""
        return (not self.ttft_ms or ttft_ms <= self.ttft_ms) and (not self.tpot_ms or tpot_ms <= self.tpot_ms)


def next_token_deadline_ms(arrival_ms: int, targets: Targets, generated: int) -> float:
    """When the request's next token is due (unix ms); NO_DEADLINE without a TTFT target."""
    if not targets.ttft_ms or not arrival_ms:
        return NO_DEADLINE
    return float(arrival_ms + targets.ttft_ms + generated * targets.tpot_ms)


def targets_of(item: queue_pb2.WorkItem) -> Targets:
    return Targets(item.slo_ttft_ms, item.slo_tpot_ms)


def item_deadline_ms(item: queue_pb2.WorkItem) -> float:
    """The next-token deadline of a queued work item (its handed-off tokens count as generated)."""
    return next_token_deadline_ms(item.arrival_unix_ms, targets_of(item), len(item.generated_token_ids))


def mean_tpot_ms(ttft_ms: float, total_ms: float, completion_tokens: int) -> float:
    """Mean time per output token after the first (0 with fewer than two tokens)."""
    if completion_tokens < 2:
        return 0.0
    return max(0.0, total_ms - ttft_ms) / (completion_tokens - 1)
