"""One request, one trace, across every service: a real OTLP receiver (opentelemetry-proto's
TraceService on a local port, in this process) and a real two-worker stack exporting to it
through the standard OTEL_* variables.

    Generate with a caller's traceparent   one trace, spans of all four services, parented right
    /v1/chat/completions with traceparent  the trace continues; the request's log line carries it
    a refused request                      its log line's trace_id/span_id are the exported span's
    SIGTERM drain of the worker mid-request  one trace: the drained worker's decode ends "handed
                                           back", the next worker's prefill resumes its tokens
    kill -9 of the worker mid-request      still one trace, with both workers' spans (run last:
                                           it leaves the stack one worker)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from llmserve.local.stack import Stack, StackConfig
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc
from tests.conftest import TEST_TENANTS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

AUTH = ("authorization", "Bearer dev-key")
SERVICES = {"gateway", "tokenizer_svc", "batcher", "gpu_worker"}


@dataclass(frozen=True)
class ExportedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    events: tuple[str, ...]


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        got = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                got += [ExportedSpan(resource.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                                     s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                                     tuple(e.name for e in s.events)) for s in scope.spans]
        with self.lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ExportedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, trace_id: str, done: Callable[[list[ExportedSpan]], bool], timeout_s: float = 60) -> list:
        """The trace's spans once `done` holds for them (the exporters batch for 100 ms here)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if done(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"trace {trace_id} incomplete: {[(s.service, s.name) for s in self.trace(trace_id)]}")


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    servicer.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer
    server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver, tmp_path_factory):
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    config = StackConfig(workers=2, device="cpu", port=0, http_port=-1, tenants=TEST_TENANTS,
                         log_dir=tmp_path_factory.mktemp("tracing"), extra_env=env,
                         extra_flags={"gpu_worker": ["--drain-timeout-s", "0"]})
    running = Stack(config).start()
    yield running
    running.close()


def traceparent() -> tuple[str, str, str]:
    """A caller's sampled W3C traceparent: (header, trace id, span id)."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def generate(stack: Stack, header: str, max_new_tokens: int = 8, on_chunk=lambda chunk: None) -> list:
    with grpc.insecure_channel(stack.gateway_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(
            temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True))
        chunks = []
        for chunk in stub.Generate(request, metadata=[AUTH, ("traceparent", header)], timeout=600):
            chunks.append(chunk)
            on_chunk(chunk)
        return chunks


def one(spans: list[ExportedSpan], service: str, name: str) -> ExportedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def request_span(spans: list[ExportedSpan]) -> ExportedSpan:
    found = [s for s in spans if s.service == "gateway" and s.attributes.get("rpc.method")]
    assert len(found) == 1, [(s.service, s.name) for s in spans]
    return found[0]


def has_all(spans: list[ExportedSpan]) -> bool:
    names = {(s.service, s.name) for s in spans}
    return {("gpu_worker", "decode"), ("batcher", "batch"), ("tokenizer_svc", "llmserve.v1.Tokenizer/Encode")} \
        <= names and any(s.attributes.get("rpc.method") for s in spans)


def test_generate_is_one_trace_across_all_four_services(stack, receiver):
    header, trace_id, caller_span = traceparent()
    chunks = generate(stack, header)
    spans = receiver.wait(trace_id, has_all)
    assert {s.service for s in spans} == SERVICES
    root = request_span(spans)
    assert root.parent_id == caller_span           # the caller's trace, continued
    assert root.name == "text_completion"           # {operation} {model}; no model named: the default
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.request.max_tokens"] == 8
    assert root.attributes["gen_ai.usage.output_tokens"] == sum(len(c.token_ids) for c in chunks) == 8
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert root.attributes["llmserve.tenant"] == "dev"
    assert root.attributes["rpc.grpc.status_code"] == "OK"
    tokenize = one(spans, "gateway", "tokenize")
    for child in (one(spans, "gateway", "admission"), tokenize, one(spans, "gateway", "stream"),
                  one(spans, "batcher", "batch"), one(spans, "gpu_worker", "queue wait"),
                  one(spans, "gpu_worker", "prefill"), one(spans, "gpu_worker", "decode")):
        assert child.parent_id == root.span_id, child
    assert one(spans, "tokenizer_svc", "llmserve.v1.Tokenizer/Encode").parent_id == tokenize.span_id
    decode = one(spans, "gpu_worker", "decode")
    assert decode.attributes["gen_ai.usage.output_tokens"] == 7      # the first token came with the prefill
    assert decode.attributes["llmserve.decode.steps"] >= 1
    assert decode.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert one(spans, "gpu_worker", "prefill").attributes["gen_ai.usage.input_tokens"] > 0


def test_http_traceparent_continues_the_trace_and_logs_carry_it(stack, receiver):
    header, trace_id, caller_span = traceparent()
    body = {"model": "", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0,
            "user": "tracing-test"}
    request = urllib.request.Request(f"{stack.http_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"authorization": "Bearer dev-key", "traceparent": header,
                                              "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        request_id = reply.headers["x-request-id"]
        assert json.load(reply)["choices"][0]["message"]["content"] is not None
    spans = receiver.wait(trace_id, has_all)
    root = request_span(spans)
    assert root.parent_id == caller_span
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["rpc.method"] == "ChatCompletions"
    assert one(spans, "gpu_worker", "decode").parent_id == root.span_id
    line = next(json.loads(x) for x in stack.services["gateway-0"].log_path.read_text().splitlines()
                if '"openai request"' in x and request_id in x)
    assert (line["trace_id"], line["span_id"], line["request_id"]) == (trace_id, root.span_id, request_id)


def test_a_refused_requests_log_line_names_its_exported_span(stack, receiver):
    header, trace_id, _ = traceparent()
    with grpc.insecure_channel(stack.gateway_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        bad = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1.0))
        with pytest.raises(grpc.RpcError) as failure:
            list(stub.Generate(bad, metadata=[AUTH, ("traceparent", header)], timeout=60))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    request_id = dict(failure.value.initial_metadata())["x-request-id"]
    root = request_span(receiver.wait(trace_id, lambda spans: any(s.attributes.get("rpc.method") for s in spans)))
    assert root.attributes["rpc.grpc.status_code"] == "INVALID_ARGUMENT"
    lines = [json.loads(x) for x in stack.services["gateway-0"].log_path.read_text().splitlines()
             if request_id in x and '"request failed"' in x]
    assert lines and all((x["trace_id"], x["span_id"]) == (trace_id, root.span_id) for x in lines), lines


def test_drain_handoff_is_one_trace_with_both_workers(stack, receiver):
    header, trace_id, _ = traceparent()
    got: list = []
    client = threading.Thread(target=lambda: got.extend(generate(stack, header, max_new_tokens=256)))
    client.start()
    prefill = receiver.wait(trace_id, lambda spans: any(s.name == "prefill" for s in spans))
    victim = one(prefill, "gpu_worker", "prefill").attributes["llmserve.worker.id"]
    stack.services[victim].signal(signal.SIGTERM)     # drain timeout 0: hands the running request back
    replacement = stack.start_worker()                 # two workers again for the kill -9 test
    client.join(600)
    assert sum(len(c.token_ids) for c in got) == 256 and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert stack.services[victim].wait(120) == 0
    spans = receiver.wait(trace_id, lambda spans: sum(s.name == "decode" for s in spans) == 2 and
                          any(s.attributes.get("rpc.method") for s in spans))
    root = request_span(spans)
    decodes = {s.attributes["llmserve.worker.id"]: s for s in spans if s.name == "decode"}
    assert all(s.parent_id == root.span_id for s in decodes.values())
    handed = decodes.pop(victim)
    assert "handed back" in handed.events and handed.attributes["llmserve.moved"] == "handed back"
    (taker, finished), = decodes.items()
    assert finished.attributes["gen_ai.response.finish_reasons"] == ("length",)
    resumed = next(s for s in spans if s.name == "prefill" and s.attributes["llmserve.worker.id"] == taker)
    assert resumed.attributes["llmserve.resumed_tokens"] > 0      # it continued from the handed-back tokens
    replacement.wait_serving(time.monotonic() + 300)


def test_kill9_failover_is_one_trace_with_both_workers(stack, receiver):
    header, trace_id, _ = traceparent()
    got: list = []
    client = threading.Thread(target=lambda: got.extend(generate(stack, header, max_new_tokens=256)))
    client.start()
    prefill = receiver.wait(trace_id, lambda spans: any(s.name == "prefill" for s in spans))
    victim = one(prefill, "gpu_worker", "prefill").attributes["llmserve.worker.id"]
    stack.kill(victim)          # mid-decode: the decode of 256 tokens has only begun
    client.join(600)
    assert sum(len(c.token_ids) for c in got) == 256 and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    spans = receiver.wait(trace_id, lambda spans: any(s.name == "decode" for s in spans) and
                          any(s.attributes.get("rpc.method") for s in spans))
    root = request_span(spans)
    prefills = [s for s in spans if s.name == "prefill"]
    assert {s.attributes["llmserve.worker.id"] for s in prefills} == \
        {victim, one(spans, "gpu_worker", "decode").attributes["llmserve.worker.id"]}
    assert len(prefills) == 2 and all(s.parent_id == root.span_id for s in prefills)
    assert one(spans, "batcher", "reclaim").attributes["llmserve.reclaimed_from"].endswith(victim)
