"""Tracing off vs on: the same closed-loop load (16 streams by default) against a stack started
without OTEL_* and one exporting every span over OTLP/gRPC to a receiver in this process.

    .venv/bin/python bench/tracing.py --streams 16 --requests 64 --output bench/results/tracing/cpu.json

Each mode gets a fresh stack (the variables are read at start-up); the modes alternate for
--rounds rounds, so a neighbour's load drifting over time lands on both. Prints tok/s side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from llmserve.loadgen.runner import RunSettings, run_closed
from llmserve.loadgen.stats import summarize
from llmserve.loadgen.workload import WorkloadConfig, build_workload, parse_dist
from llmserve.stack import Stack, StackConfig

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
        for round_ in range(args.rounds):
            runs["off"].append(_run_mode(args, {}, 1000 * round_))
            runs["on"].append(_run_mode(args, _tracing_env(port), 1000 * round_))
    finally:
        server.stop(0)
    tok_s = {mode: [r["throughput"]["output_tokens_per_s"] for r in results] for mode, results in runs.items()}
    report = {"finished_at": dt.datetime.now(dt.UTC).isoformat(),
              "config": {k: getattr(args, k) for k in ("streams", "requests", "rounds", "prompt_tokens",
                                                       "output_tokens", "workers", "device")},
              "output_tokens_per_s": tok_s, "spans_exported": sink.spans, "runs": runs}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.streams} streams  tracing off: {', '.join(f'{t:.1f}' for t in tok_s['off'])} tok/s   "
          f"on: {', '.join(f'{t:.1f}' for t in tok_s['on'])} tok/s   ({sink.spans} spans exported)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
