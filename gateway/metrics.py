"""Prometheus metrics of the gateway (served on --metrics-port by llmserve.server)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter("llmserve_gateway_requests_total", "RPCs by method, tenant and status code",
                   ["method", "tenant", "code"])
# By concrete model (NAME@VERSION), not tenant: a canary's error rate beside its stable version's.
MODEL_REQUESTS = Counter("llmserve_gateway_model_requests_total",
                         "Generate/Complete (gRPC and HTTP) by served model and status code", ["model", "code"])
REJECTIONS = Counter("llmserve_gateway_rejections_total", "admission refusals by tenant and reason",
                     ["tenant", "reason"])
TTFT = Histogram("llmserve_gateway_ttft_seconds", "arrival to first token", ["model"], buckets=_LATENCY_BUCKETS)
INTER_TOKEN = Histogram("llmserve_gateway_inter_token_seconds", "time between streamed chunks per token",
                        ["model"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
E2E = Histogram("llmserve_gateway_e2e_seconds", "arrival to last token", ["model"], buckets=_LATENCY_BUCKETS)
QUEUE = Histogram("llmserve_gateway_queue_seconds", "enqueue to worker admission", ["model"],
                  buckets=_LATENCY_BUCKETS)
ADMISSION = Histogram("llmserve_gateway_admission_seconds", "quota check round trip",
                      buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1))
IN_FLIGHT = Gauge("llmserve_gateway_streams_in_flight", "requests being streamed by this gateway")
GRAMMAR_COMPILES = Counter("llmserve_gateway_grammar_compiles_total",
                           "response_format compiles at admission by tenant and result (ok, invalid, timeout)",
                           ["tenant", "result"])
GRAMMAR_COMPILES_IN_FLIGHT = Gauge("llmserve_gateway_grammar_compiles_in_flight",
                                   "response_format compiles running or queued in the compile threads")
