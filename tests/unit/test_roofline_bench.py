"""`llmserve bench`'s roofline columns (llmserve/loadgen/roofline.py): workers' metrics scraped over
HTTP before and after a level give the level's achieved GB/s and its fraction of the probe."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from llmserve.loadgen import report, roofline
from llmserve.loadgen.stats import summarize


class WorkerMetricsEndpoint:
    """A real Prometheus endpoint serving the worker's roofline metric names with chosen values."""

    def __init__(self, probe_gbps: float) -> None:
        self.registry = CollectorRegistry()
        self.bytes = Counter("llmserve_worker_step_bytes", "", registry=self.registry)
        self.seconds = Histogram("llmserve_worker_step_seconds", "", registry=self.registry)
        Gauge("llmserve_worker_probe_bandwidth_gbps", "", registry=self.registry).set(probe_gbps)
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def step(self, nbytes: float, seconds: float) -> None:
        self.bytes.inc(nbytes)
        self.seconds.observe(seconds)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def workers():
    started = [WorkerMetricsEndpoint(20.0), WorkerMetricsEndpoint(10.0)]
    yield started
    for w in started:
        w.close()


def test_a_level_reads_the_bytes_over_the_busy_seconds_of_each_worker(workers):
    a, b = workers
    a.step(5e8, 0.5)                                     # before the level: not counted
    urls = [a.url, b.url, "http://127.0.0.1:1/metrics"]  # the last one is unreachable: left out
    before = roofline.scrape(urls)
    a.step(4e9, 0.5)
    a.step(2e9, 0.5)                                     # a: 6 GB in 1 s
    b.step(1e9, 0.25)                                    # b: 4 GB/s
    level = roofline.bandwidth(before, roofline.scrape(urls))
    assert level == {"workers": 2, "steps": 3, "step_bytes": 7e9, "step_seconds": 1.25, "achieved_gbps": pytest.approx(10.0),
                     "probe_gbps": 30.0, "fraction": pytest.approx(10.0 / 30.0)}


def test_a_worker_without_steps_or_restarted_is_left_out(workers):
    a, b = workers
    before = roofline.scrape([a.url, b.url])
    assert roofline.bandwidth(before, roofline.scrape([a.url, b.url])) is None
    restarted = roofline.WorkerSample(a.url, 0.0, 0.0, 0.0, 20.0)
    assert roofline.bandwidth(before, [restarted]) is None


def test_metrics_urls_from_flags_and_from_the_stacks_port_files(tmp_path):
    (tmp_path / "gpu_worker-0.metrics.port").write_text("9101\n")
    (tmp_path / "gpu_worker-1.metrics.port").write_text("")   # not bound yet
    (tmp_path / "gateway-0.metrics.port").write_text("9200")
    assert roofline.metrics_urls("auto", tmp_path) == ["http://127.0.0.1:9101/metrics"]
    assert roofline.metrics_urls("none", tmp_path) == []
    assert roofline.metrics_urls("h:1, http://x:2/m", tmp_path) == ["http://h:1/metrics", "http://x:2/m"]


def test_the_table_shows_the_roofline_beside_tokens_per_second():
    levels = [{"load": 1, "label": "c=1", "summary": summarize([], 1.0),
               "roofline": {"achieved_gbps": 7.25, "fraction": 0.5}},
              {"load": 2, "label": "c=2", "summary": summarize([], 1.0)}]
    header, with_meter, without = (line.split() for line in report.format_table(levels).splitlines())
    column = header.index("GB/s")
    assert header[column - 1] == "tok/s" and header[column + 1] == "of-probe"
    assert with_meter[column:column + 2] == ["7.25", "0.50"] and without[column:column + 2] == ["-", "-"]
