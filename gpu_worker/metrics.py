"""Prometheus metrics of the worker (served on --metrics-port by llmserve.runtime.server)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:  # the metrics stay importable without torch (tests/unit/test_deploy.py)
    from gpu_worker.roofline import RooflineStats

RUNNING = Gauge("llmserve_worker_running_sequences", "sequences in the running batch")
WAITING = Gauge("llmserve_worker_waiting_sequences", "sequences waiting for admission")
KV_USAGE = Gauge("llmserve_worker_kv_cache_usage_ratio", "fraction of KV blocks in use")
PREFIX_HIT_RATE = Gauge("llmserve_worker_prefix_cache_hit_ratio", "prompt tokens served from the prefix cache")
PREEMPTIONS = Counter("llmserve_worker_preemptions_total", "sequences preempted (recompute)")
GENERATED = Counter("llmserve_worker_generated_tokens_total", "tokens generated")
DRAFT_TOKENS = Counter("llmserve_worker_draft_tokens_total", "drafted tokens computed (prompt-lookup speculation)")
ACCEPTED_DRAFT_TOKENS = Counter("llmserve_worker_accepted_draft_tokens_total",
                                "drafted tokens kept: the token sampled at their position")
TOKENS_PER_S = Gauge("llmserve_worker_tokens_per_second", "generated tokens per second, last step")
STEP_SECONDS = Histogram("llmserve_worker_step_seconds", "engine step duration",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
BATCH_TOKENS = Histogram("llmserve_worker_batch_tokens", "tokens per forward step",
                         buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048))
FINISHED = Counter("llmserve_worker_finished_total", "sequences finished", ["reason"])
HANDED_BACK = Counter("llmserve_worker_handed_back_total", "sequences handed back to the queue on drain")
INBOX_DROPPED = Counter("llmserve_worker_inbox_dropped_total", "undecodable inbox entries acknowledged and dropped")
FENCED = Counter("llmserve_worker_fenced_total",
                 "sequences stopped because their request was dispatched again elsewhere (stale fencing token)")

# The roofline meter (gpu_worker/roofline.py): bytes a step had to read (weights in their stored format
# plus the KV it attended over) against its wall time and the bandwidth probed at start.
# Average bandwidth over a window: rate(llmserve_worker_step_bytes_total) / rate(llmserve_worker_step_seconds_sum).
PROBE_GBPS = Gauge("llmserve_worker_probe_bandwidth_gbps",
                   "memory bandwidth probed, best so far, GB/s (CPU: reads; CUDA: device-to-device copy)")
STEP_BYTES = Counter("llmserve_worker_step_bytes", "bytes engine steps had to read: weights + KV attended over")
ACHIEVED_GBPS = Gauge("llmserve_worker_achieved_bandwidth_gbps", "last step's bytes read over its wall time, GB/s")
BANDWIDTH_FRACTION = Gauge("llmserve_worker_bandwidth_fraction", "last step's achieved bandwidth over the probe's")
STEP_GBPS = Histogram("llmserve_worker_step_bandwidth_gbps", "achieved bandwidth per engine step, GB/s",
                      buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000))


def observe_roofline(stats: RooflineStats) -> None:
    """Export one step's roofline figures (after the step)."""
    STEP_BYTES.inc(stats.last_step_bytes)
    ACHIEVED_GBPS.set(stats.achieved_gbps)
    BANDWIDTH_FRACTION.set(stats.fraction)
    STEP_GBPS.observe(stats.achieved_gbps)
