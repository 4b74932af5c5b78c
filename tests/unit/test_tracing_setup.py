"""llmserve/runtime/tracing.py: off makes nothing; on, spans reach a real OTLP/HTTP receiver (in this
process) continuing the caller's trace, and log lines name them; the GenAI metrics."""

from __future__ import annotations

import contextvars
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import structlog
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from prometheus_client import REGISTRY

from gateway import metrics
from gpu_worker.engine.sequence import SequenceStatus
from gpu_worker.request_spans import RequestSpans
from gpu_worker.requests import Tracked
from llmserve.runtime import tracing
from llmserve.runtime.log import configure_logging
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

TRACE_ID, CALLER_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


@pytest.fixture
def otlp_http(monkeypatch):
    """A real OTLP/HTTP receiver on a free port; tracing configured to export to it."""
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name, value in {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}.items():
        monkeypatch.setenv(name, value)
    tracing.configure("unit-svc")
    yield received
    tracing.shutdown()
    server.shutdown()


def spans_of(received) -> dict[str, tuple[str, object]]:
    """name -> (service.name, span) of everything received."""
    out = {}
    for request in received:
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for scope in rs.scope_spans:
                out.update({s.name: (service, s) for s in scope.spans})
    return out


def test_off_by_default_makes_nothing(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    tracing.configure("unit-svc")
    assert not tracing.enabled()
    assert tracing.start_span("stream") is None and tracing.outgoing_metadata() is None
    with tracing.span("admission") as span:
        assert span is None
    contextvars.copy_context().run(tracing.start_request, {"traceparent": TRACEPARENT}, "r1")
    assert tracing.item_context(queue_pb2.WorkItem()) is None
    # nothing extra goes to Redis: an empty map adds no bytes to the work item
    assert queue_pb2.WorkItem(request_id="r1", trace_context=tracing.inject()).SerializeToString() == \
        queue_pb2.WorkItem(request_id="r1").SerializeToString()


@pytest.mark.parametrize("name, value", [("OTEL_TRACES_EXPORTER", "zipkin"),
                                         ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")])
def test_what_cannot_be_exported_is_refused_at_start(monkeypatch, name, value):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(name, value)
    with pytest.raises(tracing.TracingConfigError, match=name):
        tracing.configure("unit-svc")
    assert not tracing.enabled()


def _one_call() -> dict[str, str]:
    """What a gateway call does: continue the caller's trace, a child span that logs and hands its
    context on, the end with a status code. Returns the handed-on carrier."""
    tracing.start_request({"traceparent": TRACEPARENT}, "r1")
    tracing.describe_request("dev", pb.GenerateRequest(prompt="hi", model="m",
                                                       sampling=pb.SamplingParams(max_new_tokens=5)))
    with tracing.span("admission"):
        carrier = tracing.inject()
        structlog.get_logger("test").info("admitted")
    tracing.end_request("Generate", "dev", "OK")
    return carrier


def test_spans_continue_the_callers_trace_over_otlp_http(otlp_http, capsys):
    configure_logging("unit-svc")
    carrier = contextvars.copy_context().run(_one_call)
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    item = queue_pb2.WorkItem(model="m@v2", tenant="dev", request_id="r1", trace_context=carrier)
    tracing.record_dispatch("batch", [(item, time.time() - 0.01)], "w1", {"llmserve.batch.size": 1})
    tracing.shutdown()                                        # flushes the batch processor
    spans = spans_of(otlp_http)
    service, root = spans["text_completion m"]
    _, admission = spans["admission"]
    _, batch = spans["batch"]
    assert service == "unit-svc"
    assert {s.trace_id.hex() for _, s in spans.values()} == {TRACE_ID}
    assert root.parent_span_id.hex() == CALLER_SPAN
    assert admission.parent_span_id == root.span_id
    assert batch.parent_span_id == admission.span_id           # the carrier named the span current then
    assert carrier["traceparent"] == f"00-{TRACE_ID}-{admission.span_id.hex()}-01"
    assert (line["trace_id"], line["span_id"]) == (TRACE_ID, admission.span_id.hex())
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.request.max_tokens"].int_value == 5
    assert attributes["rpc.grpc.status_code"].string_value == "OK"
    assert {a.key: a.value.string_value for a in batch.attributes}["llmserve.model.version"] == "v2"


def test_genai_metrics_of_a_finished_request():
    labels = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "alias", "gen_ai_response_model": "m@v2",
              "model": "m@v2", "model_version": "v2"}

    def sample(name: str, **extra) -> float:
        return REGISTRY.get_sample_value(name, {**labels, **extra}) or 0.0

    before = {n: sample(n) for n in ("gen_ai_server_time_per_output_token_seconds_sum",
                                     "gen_ai_server_time_to_first_token_seconds_count",
                                     "gen_ai_server_request_duration_seconds_sum")}
    tokens_before = sample("gen_ai_client_token_usage_sum", gen_ai_token_type="output")
    request = pb.GenerateRequest(model="alias", messages=[pb.ChatMessage(role="user", content="hi")])
    last = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(
        prompt_tokens=7, completion_tokens=11, ttft_ms=100.0, total_ms=1100.0))
    metrics.completed(request, "m@v2", last)
    assert sample("gen_ai_server_time_to_first_token_seconds_count") == \
        before["gen_ai_server_time_to_first_token_seconds_count"] + 1
    assert sample("gen_ai_server_time_per_output_token_seconds_sum") == \
        pytest.approx(before["gen_ai_server_time_per_output_token_seconds_sum"] + 0.1)
    assert sample("gen_ai_server_request_duration_seconds_sum") == \
        pytest.approx(before["gen_ai_server_request_duration_seconds_sum"] + 1.1)
    assert sample("gen_ai_client_token_usage_sum", gen_ai_token_type="output") == tokens_before + 11


def test_log_fields_of_a_work_item():
    assert tracing.log_fields(queue_pb2.WorkItem(trace_context={"traceparent": TRACEPARENT})) == {"trace_id": TRACE_ID}
    assert tracing.log_fields(queue_pb2.WorkItem()) == {}
    assert tracing.log_fields(queue_pb2.WorkItem(trace_context={"traceparent": "garbage"})) == {}


def test_model_version_of_an_id():
    assert (tracing.model_version("smollm2-135m@v1"), tracing.model_version("plain")) == ("v1", "")


def test_a_workers_spans_of_one_request(otlp_http):
    """queue wait and prefill end at the first token; one decode span counts the rest, with an
    event per preemption; handed back ends it with the reason."""
    item = queue_pb2.WorkItem(request_id="r1", tenant="dev", model="m@v1", prompt_token_ids=[1, 2, 3],
                              enqueued_unix_ms=int(time.time() * 1000) - 5,
                              trace_context={"traceparent": TRACEPARENT},
                              sampling=queue_pb2.ResolvedSampling(max_new_tokens=16))
    tracked = Tracked.from_item(item, "1-0")
    spans = RequestSpans("gpu_worker-7")
    spans.admitted(tracked)
    for _ in range(4):                      # the prefill's token, then three decode steps
        spans.stepped(tracked, 1)
    tracked.seq.status = SequenceStatus.WAITING  # what a preemption leaves
    spans.check_preempted([tracked])
    spans.stepped(tracked, 1)
    spans.moved(tracked, "handed back")
    spans.moved(tracked, "handed back")     # a retried handoff: already ended
    tracing.shutdown()
    got = spans_of(otlp_http)
    assert set(got) == {"queue wait", "prefill", "decode"}
    decode = got["decode"][1]
    assert [e.name for e in decode.events] == ["preempted", "resumed", "handed back"]
    attributes = {a.key: a.value for a in decode.attributes}
    assert (attributes["gen_ai.usage.output_tokens"].int_value, attributes["llmserve.decode.steps"].int_value) == \
        (4, 4)
    assert attributes["llmserve.moved"].string_value == "handed back"
    assert attributes["llmserve.worker.id"].string_value == "gpu_worker-7"
    assert {s.parent_span_id.hex() for _, s in got.values()} == {CALLER_SPAN}
