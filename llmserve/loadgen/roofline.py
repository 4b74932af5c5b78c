"""The workers' roofline figures beside a bench level's tokens/s: their Prometheus metrics scraped
before and after the level (gpu_worker/metrics.py, gpu_worker/roofline.py).

Over a level each worker read `step_bytes` more bytes in `step_seconds` more seconds of engine steps:

    achieved GB/s = Σ over workers of Δllmserve_worker_step_bytes_total / Δllmserve_worker_step_seconds_sum
    of probe      = achieved / Σ llmserve_worker_probe_bandwidth_gbps of those workers

Busy time only: a worker waiting for work adds no step seconds. A worker whose counters went
backwards (it restarted during the level) or that ran no step is left out.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

STEP_BYTES = "llmserve_worker_step_bytes_total"
STEP_SECONDS = "llmserve_worker_step_seconds_sum"
STEPS = "llmserve_worker_step_seconds_count"
PROBE_GBPS = "llmserve_worker_probe_bandwidth_gbps"
SCRAPE_TIMEOUT_S = 5.0
WORKER_PORT_FILES = "gpu_worker-*.metrics.port"  # what llmserve.local.stack writes beside each worker's log


@dataclass(frozen=True)
class WorkerSample:
    """One scrape of one worker's metrics."""

    url: str
    step_bytes: float
    step_seconds: float
    steps: float
    probe_gbps: float


def parse(url: str, text: str) -> WorkerSample:
    """The roofline samples of one metrics page (0.0 for any it lacks)."""
    values = {name: 0.0 for name in (STEP_BYTES, STEP_SECONDS, STEPS, PROBE_GBPS)}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return WorkerSample(url, values[STEP_BYTES], values[STEP_SECONDS], values[STEPS], values[PROBE_GBPS])


def scrape(urls: list[str]) -> list[WorkerSample]:
    """Every reachable worker's sample; an unreachable one is left out."""
    samples = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
                samples.append(parse(url, reply.read().decode()))
        except OSError:
            continue
    return samples


def metrics_urls(spec: str, log_dir: Path) -> list[str]:
    """--worker-metrics: "none" (off), "auto" (the workers' metrics ports written under `log_dir`, as
    `llmserve up` does under .llmserve/logs/), or a comma list of HOST:PORT or URLs."""
    if spec == "none":
        return []
    if spec == "auto":
        ports = [path.read_text().strip() for path in sorted(log_dir.glob(WORKER_PORT_FILES))]
        return [f"http://127.0.0.1:{port}/metrics" for port in ports if port.isdigit()]
    return [part if "://" in part else f"http://{part}/metrics" for part in (p.strip() for p in spec.split(",")) if part]


def bandwidth(before: list[WorkerSample], after: list[WorkerSample]) -> dict | None:
    """The level's achieved GB/s, probe GB/s and fraction over the workers seen in both scrapes (None: none ran)."""
    start = {s.url: s for s in before}
    read_bytes = seconds = steps = achieved = probe = 0.0
    workers = 0
    for end in after:
        begin = start.get(end.url)
        if begin is None or end.step_seconds <= begin.step_seconds or end.step_bytes < begin.step_bytes:
            continue
        delta_bytes, delta_s = end.step_bytes - begin.step_bytes, end.step_seconds - begin.step_seconds
        read_bytes, seconds, workers = read_bytes + delta_bytes, seconds + delta_s, workers + 1
        steps += end.steps - begin.steps
        achieved += delta_bytes / delta_s / 1e9
        probe += end.probe_gbps
    if not workers:
        return None
    return {"workers": workers, "steps": steps, "step_bytes": read_bytes, "step_seconds": seconds,
            "achieved_gbps": achieved, "probe_gbps": probe, "fraction": achieved / probe if probe > 0 else None}
