"""The TTFT estimate behind early refusal (gateway/slo_estimate.py): concrete queue and rate cases."""

from __future__ import annotations

import pytest

from gateway.slo_estimate import HORIZON_S, MIN_SAMPLES, ServiceEstimate
from llmserve.v1 import inference_pb2

NORMAL, HIGH = inference_pb2.PRIORITY_NORMAL, inference_pb2.PRIORITY_HIGH
INTERACTIVE = 4_000   # ms TTFT target
BATCH = 40_000


def measured(est: ServiceEstimate, n: int, *, at: float, queue_ms: float = 10, worker_ms: float = 300,
             ahead: int = 0, tokens: int = 50, target: int = INTERACTIVE, priority: int = NORMAL) -> None:
    for i in range(n):
        est.started("m", priority, ahead, queue_ms, worker_ms, tokens, target, now=at + i * 0.01)


def predict(est: ServiceEstimate, *, now: float, ahead: int = 0, tokens: int = 50, target: int = INTERACTIVE,
            waited_ms: float = 0, priority: int = NORMAL) -> float | None:
    return est.ttft_ms("m", priority, waited_ms, ahead, tokens, target, now=now)


def test_the_prediction_is_the_wait_so_far_plus_the_queue_per_request_ahead_plus_the_worker_time():
    est = ServiceEstimate()
    measured(est, MIN_SAMPLES, at=0.0, queue_ms=500, ahead=4, worker_ms=300)   # 100 ms per request queued
    assert predict(est, now=1.0, waited_ms=5, ahead=9) == pytest.approx(5 + 10 * 100 + 300)
    assert predict(est, now=1.0, priority=HIGH) is None                          # samples are per priority


def test_an_idle_stack_never_refuses_a_feasible_target():
    est = ServiceEstimate()
    assert predict(est, now=0.0) is None                                        # nothing measured yet
    measured(est, 20, at=0.0)                                                   # 10 ms queue + 300 ms
    predicted = predict(est, now=1.0, waited_ms=20)
    assert predicted is not None and predicted < INTERACTIVE
    measured(est, MIN_SAMPLES, at=2.0, tokens=300, worker_ms=1_200, target=BATCH)
    assert predict(est, now=3.0, tokens=300, target=BATCH) < BATCH


def test_an_overloaded_stack_refuses_what_it_cannot_serve_in_time():
    est = ServiceEstimate()
    measured(est, 10, at=0.0, worker_ms=6_000)                                  # the worker is backed up
    assert predict(est, now=1.0) > INTERACTIVE
    measured(est, 10, at=2.0, queue_ms=5 * 900, ahead=4, worker_ms=300)         # now the queue: 900 ms a request
    assert predict(est, now=3.0, ahead=5) == pytest.approx(6 * 900 + 300)
    assert predict(est, now=3.0, ahead=0) < INTERACTIVE                         # its queue drained: admit


def test_stale_samples_expire_so_refusals_cannot_last_forever():
    est = ServiceEstimate()
    measured(est, 10, at=0.0, worker_ms=60_000)
    assert predict(est, now=HORIZON_S) > INTERACTIVE
    assert predict(est, now=HORIZON_S + 1) is None


def test_other_requests_keep_measuring_but_never_keep_a_refused_kind_refused():
    """Interactive requests refused after a burst are not measured; batch ones, with longer prompts and a
    looser target, still are, yet their samples never predict an interactive request's TTFT."""
    est = ServiceEstimate()
    measured(est, 10, at=0.0, worker_ms=8_000)                                  # the burst: interactive slow
    for second in range(1, 30):                                                 # batch requests keep arriving
        measured(est, 1, at=float(second), tokens=300, worker_ms=9_000, target=BATCH)
    assert predict(est, now=HORIZON_S + 1) is None                              # interactive: admitted, re-measured
    assert predict(est, now=29.5, tokens=300, target=BATCH) == pytest.approx(9_000 + 10)


def test_a_lone_slow_request_refuses_nothing_and_a_recovery_shows_at_once():
    est = ServiceEstimate()
    measured(est, 1, at=0.0, worker_ms=30_000)                                  # a cold start
    measured(est, 2, at=0.1)
    assert predict(est, now=1.0) < INTERACTIVE                                  # median of 3
    slow = ServiceEstimate()
    measured(slow, 9, at=0.0, worker_ms=8_000)
    measured(slow, 1, at=1.0)                                                   # the first fast one since
    assert predict(slow, now=1.5) < INTERACTIVE


def test_too_few_like_samples_predict_nothing():
    est = ServiceEstimate()
    measured(est, MIN_SAMPLES - 1, at=0.0, worker_ms=60_000)
    assert predict(est, now=1.0) is None
    measured(est, 10, at=0.0, tokens=2_000, worker_ms=60_000)                   # longer prompts: not like it
    measured(est, 10, at=0.0, tokens=10, worker_ms=60_000)                      # under half its length
    measured(est, 10, at=0.0, worker_ms=60_000, target=BATCH)                   # a looser target waits longer
    assert predict(est, now=1.0) is None
    assert predict(est, now=1.0, tokens=2_000, target=BATCH) > BATCH             # but those predict their own
