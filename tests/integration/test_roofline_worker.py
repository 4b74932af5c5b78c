"""A real worker process (`python -m gpu_worker`, tiny random Llama, real Valkey) probes its memory
bandwidth at start and, after a request, exports the roofline meter on its metrics port: the probe,
the bytes its steps read, the last step's GB/s and fraction, and `llmserve bench`'s scraper reads them."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_worker_service import Worker, dispatch, make_item, prompt, wait_final, write_tiny_llama

from llmserve.loadgen import roofline


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def metrics_url(port_file: Path, worker: Worker, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not (port_file.exists() and port_file.read_text().strip()):
        assert worker.proc.poll() is None, f"worker exited: {worker.proc.stderr.read()}"
        assert time.monotonic() < deadline, "no metrics port written"
        time.sleep(0.1)
    return f"http://127.0.0.1:{int(port_file.read_text())}/metrics"


def samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_worker_exports_the_roofline_gauges_after_a_request(redis_url, clean_redis, model_dir, tmp_path):
    port_file = tmp_path / "gpu_worker-0.metrics.port"
    worker = Worker(redis_url, model_dir, "w-roofline", "--metrics-port", "-1", "--metrics-port-file", str(port_file))
    try:
        worker.wait_ready(clean_redis)
        url = metrics_url(port_file, worker)
        start = samples(url)
        assert start["llmserve_worker_probe_bandwidth_gbps"] > 0
        before = roofline.scrape([url])
        items = [make_item("roof-1", prompt(20, 1), 8), make_item("roof-2", prompt(9, 2), 8)]
        dispatch(clean_redis, "w-roofline", items)
        wait_final(clean_redis, items)
        after = samples(url)
        read = after["llmserve_worker_step_bytes_total"] - start.get("llmserve_worker_step_bytes_total", 0.0)
        assert read > 0 and after["llmserve_worker_step_bandwidth_gbps_count"] >= 8
        assert after["llmserve_worker_achieved_bandwidth_gbps"] > 0
        assert after["llmserve_worker_bandwidth_fraction"] == pytest.approx(
            after["llmserve_worker_achieved_bandwidth_gbps"] / after["llmserve_worker_probe_bandwidth_gbps"])
        level = roofline.bandwidth(before, roofline.scrape(roofline.metrics_urls("auto", tmp_path)))
        assert level is not None and level["workers"] == 1 and level["step_bytes"] == read
        assert level["achieved_gbps"] > 0 and level["fraction"] > 0
    finally:
        worker.kill()
