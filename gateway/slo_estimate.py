"""What a new request's time to first token will be, from requests like it this gateway measured lately.

Each request's first token leaves a sample (per model and priority):

    queue    ms of queue wait per request ahead (enqueue → worker admission, over 1 + the
             requests queued at its priority or above when it was submitted)
    worker   ms from worker admission to the first token at the gateway (its wait in the
             worker, its prefill and the steps it shared with others)

and a new request's TTFT is predicted only from samples of requests that were served no later
than it will be, under the load of the last HORIZON_S:

    like it     measured within HORIZON_S, no more prompt tokens than it but at least half as
                many, and a TTFT target no looser than its own (earliest deadline first: a
                looser target waits longer, so its samples say nothing about a tighter one)
    predicted   waited so far + min(median over like, the latest like)
                of (1 + ahead now) * queue + worker

Fewer than MIN_SAMPLES like it predicts nothing (no refusal). Each choice errs towards
admitting: the median ignores a lone slow request (a cold start), the latest sample lets a
recovery show at once, and a longer prompt's or looser target's samples never count against
a request. When every request of one kind is refused, none of that kind is measured, so its
samples expire after HORIZON_S and the next ones are admitted and measured afresh, instead of a
past overload's estimate refusing forever, whatever other kinds of request keep being measured.

Queue depth is global (every gateway reads the same streams), so the queue rate needs no
agreement between replicas.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

HORIZON_S = 10.0     # samples older than this predict nothing
MIN_SAMPLES = 3      # fewer like samples than this predict nothing
_KEPT = 64           # samples kept per model and priority


@dataclass(frozen=True)
class Sample:
    """One request's first token: when, how large it was, and how long its two waits took."""

    at: float                    # monotonic s
    prompt_tokens: int           # not served from the prefix cache
    ttft_target_ms: float        # inf without a target
    queue_ms_per_request: float  # queue wait over 1 + the requests ahead at submit
    worker_ms: float             # worker admission → first token at the gateway

    def like(self, prompt_tokens: int, ttft_target_ms: float, now: float) -> bool:
        """Whether a request of `prompt_tokens` with this target will be served no sooner than this one was."""
        return (now - self.at <= HORIZON_S and prompt_tokens / 2 <= self.prompt_tokens <= prompt_tokens
                and self.ttft_target_ms <= ttft_target_ms)

    def ttft_ms(self, ahead: int) -> float:
        """This sample's TTFT after admission, had `ahead` requests been queued before it."""
        return (1 + max(0, ahead)) * self.queue_ms_per_request + self.worker_ms


def _target(ttft_target_ms: float) -> float:
    return ttft_target_ms if ttft_target_ms > 0 else math.inf


class ServiceEstimate:
    """Recent first-token samples per model and priority; `ttft_ms` predicts a new request's TTFT."""

    def __init__(self) -> None:
        self._samples: dict[tuple[str, int], deque[Sample]] = {}

    def started(self, model: str, priority: int, ahead: int, queue_ms: float, worker_ms: float,
                prompt_tokens: int, ttft_target_ms: float, now: float | None = None) -> None:
        """A request's first token arrived: it waited `queue_ms` behind `ahead` others, then its
        `prompt_tokens` (not served from the prefix cache) took `worker_ms` to a first token;
        `ttft_target_ms` is its target (0: none)."""
        sample = Sample(time.monotonic() if now is None else now, prompt_tokens, _target(ttft_target_ms),
                        max(0.0, queue_ms) / (1 + max(0, ahead)), max(0.0, worker_ms))
        self._samples.setdefault((model, priority), deque(maxlen=_KEPT)).append(sample)

    def ttft_ms(self, model: str, priority: int, waited_ms: float, ahead: int, prompt_tokens: int,
                ttft_target_ms: float, now: float | None = None) -> float | None:
        """Predicted TTFT of a request that arrived `waited_ms` ago, with `ahead` requests queued
        before it; None with fewer than MIN_SAMPLES like it (see the module docstring)."""
        now = time.monotonic() if now is None else now
        target = _target(ttft_target_ms)
        like = [s for s in self._samples.get((model, priority), ()) if s.like(prompt_tokens, target, now)]
        if len(like) < MIN_SAMPLES:
            return None
        typical = statistics.median(s.ttft_ms(ahead) for s in like)
        return waited_ms + min(typical, like[-1].ttft_ms(ahead))
