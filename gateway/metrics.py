"""Prometheus metrics of the gateway (served on --metrics-port by llmserve.runtime.server)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from llmserve.runtime import tracing
from llmserve.v1 import inference_pb2 as pb

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

# OTel GenAI server metrics (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-metrics/), beside the
# vLLM-style names above: the attribute names as labels (dots → underscores), the buckets the conventions
# advise, and `model` / `model_version` as every other series here.
_GENAI_LABELS = ["gen_ai_operation_name", "gen_ai_request_model", "gen_ai_response_model", "model", "model_version"]
GENAI_TTFT = Histogram("gen_ai_server_time_to_first_token_seconds",
                       "GenAI: arrival to the first output token, per finished request", _GENAI_LABELS,
                       buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                7.5, 10.0))
GENAI_TPOT = Histogram("gen_ai_server_time_per_output_token_seconds",
                       "GenAI: time per output token after the first, per finished request", _GENAI_LABELS,
                       buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5))
GENAI_DURATION = Histogram("gen_ai_server_request_duration_seconds",
                           "GenAI: arrival to the last output token, per finished request", _GENAI_LABELS,
                           buckets=(0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
                                    81.92))
GENAI_TOKENS = Histogram("gen_ai_client_token_usage",
                         "GenAI: input and output tokens per finished request (gen_ai.client.token.usage, "
                         "measured at the server)", [*_GENAI_LABELS, "gen_ai_token_type"],
                         buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576))


def completed(request: pb.GenerateRequest, model: str, last: pb.GenerateResponse) -> None:
    """A request's last chunk (it carries the usage): the GenAI metrics, and the same usage and
    finish reason on the request's span.

    Args:
        request: what the caller asked (operation, requested model).
        model: the concrete NAME@VERSION that served it.
        last: the final chunk, with `usage` set.
    """
    usage = last.usage
    finish = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    tracing.describe_completion(model, usage, finish)
    labels = (tracing.operation_of(request), request.model or model, model, model, tracing.model_version(model))
    GENAI_TTFT.labels(*labels).observe(usage.ttft_ms / 1000)
    GENAI_DURATION.labels(*labels).observe(usage.total_ms / 1000)
    if usage.completion_tokens > 1:
        GENAI_TPOT.labels(*labels).observe((usage.total_ms - usage.ttft_ms) / 1000 / (usage.completion_tokens - 1))
    GENAI_TOKENS.labels(*labels, "input").observe(usage.prompt_tokens)
    GENAI_TOKENS.labels(*labels, "output").observe(usage.completion_tokens)
