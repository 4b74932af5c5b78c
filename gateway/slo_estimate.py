"""What a new request's time to first token will be, from what this gateway measured lately.

Two measured rates, each an exponentially weighted mean over recent requests of one model:

    queue    ms of queue wait per request ahead (enqueue → worker admission, over 1 + the
             requests queued at its priority or above when it was submitted), per priority
    prefill  ms from worker admission to the first token at the gateway, fitted as
             a + b * prompt_tokens (decayed least squares; proportional while prompts are all
             of one length)

    predicted TTFT = waited so far + (1 + ahead now) * queue rate + a + b * prompt tokens

Queue depth is global (every gateway reads the same streams), so the queue rate needs no
agreement between replicas. Nothing measured predicts nothing (no refusal), and neither does a
measure older than HORIZON_S: when every request is being refused, none is measured, so the
next one after the horizon is admitted and measured afresh instead of the estimate of a past
overload refusing forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

HORIZON_S = 10.0       # a model's estimate older than this predicts nothing
_DECAY = 0.9           # weight of the past in each mean: about the last ten requests count
_MIN_SPREAD = 16.0     # tokens: below this standard deviation of prompt lengths, no slope is fitted


@dataclass
class _Mean:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else _DECAY * self.value + (1 - _DECAY) * x


@dataclass
class _Fit:
    """Decayed least squares of y = a + b x."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.w, self.x, self.y = _DECAY * self.w + 1, _DECAY * self.x + x, _DECAY * self.y + y
        self.xx, self.xy = _DECAY * self.xx + x * x, _DECAY * self.xy + x * y

    def predict(self, x: float) -> float | None:
        if not self.w:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        slope = (self.xy / self.w - mx * my) / var if var > _MIN_SPREAD ** 2 else 0.0
        if slope <= 0:
            return my * x / mx if mx > 0 else my
        return max(0.0, my + slope * (x - mx))


@dataclass
class _Model:
    queue: dict[int, _Mean]
    prefill: _Fit
    measured_at: float = 0.0   # monotonic time of the last measure


class ServiceEstimate:
    """Measured queue and prefill rates per model; `ttft_ms` predicts a new request's TTFT."""

    def __init__(self) -> None:
        self._models: dict[str, _Model] = {}

    def _of(self, model: str) -> _Model:
        return self._models.setdefault(model, _Model({}, _Fit()))

    def started(self, model: str, priority: int, ahead: int, queue_ms: float, prefill_ms: float,
                prompt_tokens: int, now: float | None = None) -> None:
        """A request's first token arrived: it waited `queue_ms` behind `ahead` others, then its
        `prompt_tokens` (not served from the prefix cache) took `prefill_ms` to a first token."""
        entry = self._of(model)
        entry.queue.setdefault(priority, _Mean()).add(max(0.0, queue_ms) / (1 + max(0, ahead)))
        entry.prefill.add(float(prompt_tokens), max(0.0, prefill_ms))
        entry.measured_at = time.monotonic() if now is None else now

    def ttft_ms(self, model: str, priority: int, waited_ms: float, ahead: int, prompt_tokens: int,
                now: float | None = None) -> float | None:
        """Predicted TTFT of a request that arrived `waited_ms` ago, with `ahead` requests queued
        before it; None until a request of this model and priority was measured, and once the
        model's last measure is older than HORIZON_S."""
        entry = self._models.get(model)
        if entry is not None and (time.monotonic() if now is None else now) - entry.measured_at > HORIZON_S:
            return None
        rate = entry.queue.get(priority) if entry else None
        prefill = entry.prefill.predict(prompt_tokens) if entry else None
        if rate is None or rate.value is None or prefill is None:
            return None
        return waited_ms + (1 + ahead) * rate.value + prefill
