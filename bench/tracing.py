"""Tracing off vs on: the same closed-loop load (16 streams by default) against a stack started
without OTEL_* and one exporting every span over OTLP/gRPC to a receiver in this process.

    .venv/bin/python bench/tracing.py --streams 16 --requests 64 --output bench/results/tracing/cpu.json

Each mode gets a fresh stack (the variables are read at start-up); the modes alternate for
--rounds rounds, so a neighbour's load drifting over time lands on both. Prints tok/s side by side.

It also times, in this process, the tracing calls one request makes across the services (gateway
request/admission/tokenize/stream, batcher dispatch, worker queue wait/prefill/decode over 32
tokens) with tracing off and on: a figure a loaded machine's noise cannot hide.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gpu_worker.request_spans import RequestSpans
from gpu_worker.requests import Tracked
from llmserve.loadgen.runner import RunSettings, run_closed
from llmserve.loadgen.stats import summarize
from llmserve.loadgen.workload import WorkloadConfig, build_workload, parse_dist
from llmserve.local.stack import Stack, StackConfig
from llmserve.runtime import tracing
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

REPO = Path(__file__).resolve().parent.parent
TENANTS = REPO / "tests" / "data" / "tenants.test.yaml"


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver that only counts what it is sent."""

    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()

    def Export(self, request, context):
        count = sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)
        with self.lock:
            self.spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def _tracing_env(port: int) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}


def _run_mode(args: argparse.Namespace, env: dict[str, str], seed: int) -> dict:
    config = StackConfig(workers=args.workers, device=args.device, port=0, tenants=TENANTS, extra_env=env)
    stack = Stack(config).start()
    try:
        settings = RunSettings(target=stack.gateway_target, temperature=0.0)
        lengths = {"prompt_tokens": parse_dist(args.prompt_tokens), "output_tokens": parse_dist(args.output_tokens)}
        warmup = WorkloadConfig(requests=args.streams, seed=seed + 1, **lengths)
        asyncio.run(run_closed(build_workload(warmup), args.streams, settings))    # not measured
        measured = WorkloadConfig(requests=args.requests, seed=seed, **lengths)
        results, wall = asyncio.run(run_closed(build_workload(measured), args.streams, settings))
        return summarize(results, wall)
    finally:
        stack.close()


def _one_request(request: pb.GenerateRequest, tracked: Tracked, spans: RequestSpans, tokens: int) -> None:
    """The tracing calls of one request, in the order the services make them."""
    tracing.start_request({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "r")
    tracing.describe_request("dev", request)
    with tracing.span("admission"):
        pass
    with tracing.span("tokenize"):
        tracing.outgoing_metadata()
    tracked.item.trace_context.update(tracing.inject())
    stream = tracing.start_span("stream")
    tracing.record_dispatch("batch", [(tracked.item, time.time())], "w")
    spans.admitted(tracked)
    for _ in range(tokens):
        spans.stepped(tracked, 1)
    spans.ended(tracked, pb.FINISH_REASON_LENGTH)
    tracing.end_span(stream, {tracing.OUTPUT_TOKENS: tokens})
    tracing.end_request("Generate", "dev", "OK")


def helper_us_per_request(requests: int, tokens: int = 32) -> float:
    """Microseconds of tracing calls per request, in this process's current tracing state."""
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=tokens))
    item = queue_pb2.WorkItem(request_id="r", tenant="dev", model="m@v1", prompt_token_ids=[1, 2, 3])
    tracked, spans = Tracked.from_item(item, "1-0"), RequestSpans("w")
    start = time.perf_counter()
    for _ in range(requests):
        _one_request(request, tracked, spans, tokens)
    return (time.perf_counter() - start) / requests * 1e6


def helper_cost(port: int) -> dict[str, float]:
    """helper_us_per_request with tracing off, then on (exporting to the sink on `port`)."""
    off = helper_us_per_request(20000)
    os.environ.update(_tracing_env(port))
    tracing.configure("bench")
    try:
        on = helper_us_per_request(1000)   # within the batch processor's queue: every span is exported
    finally:
        tracing.shutdown()
        for name in _tracing_env(port):
            del os.environ[name]
    return {"off": off, "on": on}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=16, help="concurrent streams (closed loop)")
    p.add_argument("--requests", type=int, default=64, help="measured requests per mode and round")
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs, alternating")
    p.add_argument("--prompt-tokens", default="uniform:16:64")
    p.add_argument("--output-tokens", default="32")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--output", default="", help="write the JSON report here (e.g. bench/results/tracing/cpu.json)")
    args = p.parse_args(argv)

    sink, server = SpanSink(), grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        helper_us = helper_cost(port)
        for round_ in range(args.rounds):
            runs["off"].append(_run_mode(args, {}, 1000 * round_))
            runs["on"].append(_run_mode(args, _tracing_env(port), 1000 * round_))
    finally:
        server.stop(0)
    tok_s = {mode: [r["throughput"]["output_tokens_per_s"] for r in results] for mode, results in runs.items()}
    report = {"finished_at": dt.datetime.now(dt.UTC).isoformat(),
              "config": {k: getattr(args, k) for k in ("streams", "requests", "rounds", "prompt_tokens",
                                                       "output_tokens", "workers", "device")},
              "output_tokens_per_s": tok_s, "spans_exported": sink.spans,
              "tracing_calls_us_per_request": helper_us, "runs": runs}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.streams} streams  tracing off: {', '.join(f'{t:.1f}' for t in tok_s['off'])} tok/s   "
          f"on: {', '.join(f'{t:.1f}' for t in tok_s['on'])} tok/s   ({sink.spans} spans exported)\n"
          f"tracing calls per request: off {helper_us['off']:.1f} us, on {helper_us['on']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
