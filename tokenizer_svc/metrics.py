"""Prometheus metrics of tokenizer_svc (registered once, on import)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

QUEUE_DEPTH = Gauge("tokenizer_pool_queue_depth",
                    "Tasks sent to a pool process and not answered yet", ["process", "lane"])
POOL_PROCESSES = Gauge("tokenizer_pool_processes_ready", "Pool processes ready for work")
RESTARTS = Counter("tokenizer_pool_restarts_total", "Pool processes that died and were replaced")
RETRIES = Counter("tokenizer_pool_retries_total", "Tasks sent again after their pool process died")
REQUEST_LATENCY = Histogram("tokenizer_request_seconds", "Latency of one encode/decode inside the service",
                            ["model", "op"], buckets=_LATENCY_BUCKETS)
TOKENS = Counter("tokenizer_tokens_total", "Token ids produced by encodes (rate() = tokens/s)", ["model"])
CACHE_LOOKUPS = Counter("tokenizer_cache_lookups_total",
                        "Cache lookups: cache=request (whole request, front) or segment (chat segments, pool)",
                        ["cache", "result"])
CACHE_BYTES = Gauge("tokenizer_cache_bytes", "Bytes held by the front's request cache")
