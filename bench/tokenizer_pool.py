"""Tokenizer pool benchmark (issue 4).

Encode throughput (tokens/s) and p50/p99 latency of tokenizer_svc under 1, 8 and 64
concurrent clients, mixed workload (short chat turns + 8k-token documents), pool sizes
1 and 2, next to the `tokenizers` library called directly in one process (encode_batch).
Also measures the chat segment cache (system prompt / earlier turns) in-process.

    .venv/bin/python bench/tokenizer_pool.py [--duration-s 5] [--clients 1,8,64] [--pools 1,2]

Prints a table; writes bench/results/tokenizer_pool.json and .png. The client runs in
this process (asyncio gRPC), on the same machine as the service: on a small machine
the client's own CPU use competes with the pool's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve.catalog import model_store  # noqa: E402
from llmserve.v1 import inference_pb2 as ipb  # noqa: E402
from llmserve.v1 import tokenizer_pb2 as pb  # noqa: E402
from llmserve.v1 import tokenizer_pb2_grpc  # noqa: E402
from tokenizer_svc.loader import ModelTokenizer, load_tokenizer  # noqa: E402
from tokenizer_svc.segments import SegmentEncoder  # noqa: E402

SYSTEM = ("You are a support assistant for ACME Cloud. Answer briefly, cite the relevant documentation page, "
          "never reveal internal ticket numbers, and escalate billing disputes to a human.")
WORDS = ("the server region quota billing latency deploy rollback token cache error timeout network disk "
         "memory 42 2024 you we they why how when 你好 数据 🎉 def return x+1").split()
LONG_TOKENS = 8192


# ------------------------------------------------------------------------------------ workload

class Workload:
    """Deterministic mix: every `long_every`-th request is an 8k-token document, the rest short chat turns."""

    def __init__(self, model: ModelTokenizer, long_every: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.long_every = long_every
        self.counter = 0
        base = (REPO / "README.md").read_text()     # a long, mixed English + code document
        ids = model.encode(base * (1 + 4 * LONG_TOKENS // max(1, len(model.encode(base)))))
        self.document = model.decode(ids[:LONG_TOKENS])

    def next(self) -> tuple[str, pb.EncodeRequest]:
        self.counter += 1
        if self.counter % self.long_every == 0:
            return "long", pb.EncodeRequest(text=f"[doc {self.counter}]\n{self.document}")
        user = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(8, 40)))
        messages = [ipb.ChatMessage(role="system", content=SYSTEM), ipb.ChatMessage(role="user", content=user)]
        return "short", pb.EncodeRequest(messages=messages)

    def local_text(self, model: ModelTokenizer, request: pb.EncodeRequest) -> str:
        if request.messages:
            return model.render_chat([{"role": m.role, "content": m.content} for m in request.messages])
        return request.text


# ------------------------------------------------------------------------------------ service

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_service(workers: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenizer_svc", "--port", str(port), "--workers", str(workers),
         "--cache-bytes", "0", "--log-level", "warning"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 180
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return process, port
            except grpc.RpcError:
                time.sleep(0.2)
    process.kill()
    raise TimeoutError("tokenizer_svc did not start")


@dataclass
class Cell:
    system: str
    pool: int
    clients: int
    requests: int
    tokens_per_s: float
    short_p50_ms: float
    short_p99_ms: float
    long_p50_ms: float
    long_p99_ms: float
    short_p99_with_long_in_flight_ms: float
    service_cpu_cores: float = float("nan")  # CPU the service (front + pool) used, in cores


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def _summarise(system: str, pool: int, clients: int, records: list, wall: float) -> Cell:
    shorts = [r for r in records if r[0] == "short"]
    longs = [r for r in records if r[0] == "long"]
    overlapping = [s for s in shorts if any(l_[1] < s[2] and s[1] < l_[2] for l_ in longs)]
    return Cell(system, pool, clients, len(records), sum(r[3] for r in records) / wall,
                _pct([r[2] - r[1] for r in shorts], 0.5), _pct([r[2] - r[1] for r in shorts], 0.99),
                _pct([r[2] - r[1] for r in longs], 0.5), _pct([r[2] - r[1] for r in longs], 0.99),
                _pct([r[2] - r[1] for r in overlapping], 0.99))


async def run_clients(port: int, workload: Workload, clients: int, duration_s: float) -> tuple[list, float]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    records: list[tuple[str, float, float, int]] = []
    for _ in range(4):  # warm-up
        await stub.Encode(workload.next()[1])
    started = time.perf_counter()
    stop_at = started + duration_s

    async def client() -> None:
        while time.perf_counter() < stop_at:
            kind, request = workload.next()
            t0 = time.perf_counter()
            reply = await stub.Encode(request, timeout=60)
            records.append((kind, t0, time.perf_counter(), len(reply.token_ids)))

    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - started
    await channel.close()
    return records, wall


def _cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process and its children (the pool processes)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    total = 0
    for p in [str(pid), *children]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def bench_service(pools: list[int], clients_list: list[int], duration_s: float, model: ModelTokenizer,
                  long_every: int) -> list[Cell]:
    """Both pool sizes started up front and measured back to back per client count (less drift on a
    shared machine)."""
    servers = {pool: start_service(pool) for pool in pools}
    try:
        cells = []
        for clients in clients_list:
            for pool, (process, port) in servers.items():
                workload = Workload(model, long_every, seed=clients)
                cpu_before = _cpu_seconds(process.pid)
                records, wall = asyncio.run(run_clients(port, workload, clients, duration_s))
                cell = _summarise("service", pool, clients, records, wall)
                cell.service_cpu_cores = (_cpu_seconds(process.pid) - cpu_before) / wall
                cells.append(cell)
                print_row(cell)
        return cells
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)


def bench_baseline(clients_list: list[int], duration_s: float, model: ModelTokenizer, long_every: int,
                   method: str = "encode_batch") -> list[Cell]:
    """`tokenizers` encode_batch (or encode_batch_fast: no offsets, what the service uses for long texts)
    in this process, rayon threads on; one batch = `clients` requests; latency = the batch's."""
    encode_batch = getattr(model.tokenizer, method)
    cells = []
    for clients in clients_list:
        workload = Workload(model, long_every, seed=clients)
        records = []
        started = time.perf_counter()
        while time.perf_counter() < started + duration_s:
            batch = [workload.next() for _ in range(clients)]
            texts = [workload.local_text(model, request) for _, request in batch]
            t0 = time.perf_counter()
            encodings = encode_batch(texts, add_special_tokens=False)
            t1 = time.perf_counter()
            records += [(kind, t0, t1, len(e.ids)) for (kind, _), e in zip(batch, encodings)]
        cells.append(_summarise(f"tokenizers.{method}", 1, clients, records, time.perf_counter() - started))
        print_row(cells[-1])
    return cells


# ------------------------------------------------------------------------------------ segment cache

def bench_segment_cache(model: ModelTokenizer, rounds: int = 300) -> list[dict]:
    """CPU per chat encode with and without the segment cache, by system prompt length."""
    rows = []
    for repeat in (1, 8, 48):
        system = SYSTEM * repeat
        encoder = SegmentEncoder(model, max_bytes=16 << 20)
        prompts = [model.render_chat([{"role": "system", "content": system},
                                      {"role": "user", "content": f"question number {i}: why is the sky blue?"}])
                   for i in range(rounds)]
        t0 = time.perf_counter()
        plain = [model.encode(p) for p in prompts]
        t1 = time.perf_counter()
        cached = [encoder.encode(p) for p in prompts]
        t2 = time.perf_counter()
        assert plain == cached, "segment cache changed the ids"
        rows.append({"system_tokens": len(model.encode(system)), "whole_prompt_us": (t1 - t0) / rounds * 1e6,
                     "segment_cached_us": (t2 - t1) / rounds * 1e6, "speedup": (t1 - t0) / (t2 - t1)})
    return rows


# ------------------------------------------------------------------------------------ output

HEADER = (f"{'system':<29}{'pool':>5}{'clients':>8}{'reqs':>7}{'tokens/s':>12}{'short p50':>11}{'short p99':>11}"
          f"{'long p50':>10}{'long p99':>10}{'short p99|long':>16}{'svc cores':>11}")


def print_row(cell: Cell) -> None:
    print(f"{cell.system:<29}{cell.pool:>5}{cell.clients:>8}{cell.requests:>7}{cell.tokens_per_s:>12,.0f}"
          f"{cell.short_p50_ms:>11.2f}{cell.short_p99_ms:>11.2f}{cell.long_p50_ms:>10.1f}{cell.long_p99_ms:>10.1f}"
          f"{cell.short_p99_with_long_in_flight_ms:>16.2f}{cell.service_cpu_cores:>11.2f}", flush=True)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    systems = sorted({(c.system, c.pool) for c in cells})
    clients = sorted({c.clients for c in cells})
    width = 0.8 / len(systems)
    for k, (system, pool) in enumerate(systems):
        row = {c.clients: c for c in cells if (c.system, c.pool) == (system, pool)}
        xs = [i + k * width for i in range(len(clients))]
        label = system if system != "service" else f"service, pool={pool}"
        ax1.bar(xs, [row[c].tokens_per_s / 1e3 if c in row else 0 for c in clients], width, label=label)
        ax2.bar(xs, [row[c].short_p99_ms if c in row else 0 for c in clients], width, label=label)
    for ax, title in ((ax1, "encode throughput (k tokens/s)"), (ax2, "short-request p99 latency (ms)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(clients))], [f"{c} clients" for c in clients])
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax2.axhline(10, color="red", linestyle="--", linewidth=1)
    fig.suptitle(f"tokenizer_svc, SmolLM2 tokenizer, mixed short chat + {LONG_TOKENS}-token docs "
                 f"({os.cpu_count()} CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds per cell")
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--pools", default="1,2")
    parser.add_argument("--long-every", type=int, default=8, help="every n-th request is an 8k-token document")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    model = load_tokenizer(model_store.fetch())
    print(f"CPU cores: {os.cpu_count()}; load average before: {os.getloadavg()[0]:.2f}")
    print(HEADER)
    cells = bench_baseline(clients, args.duration_s, model, args.long_every)
    cells += bench_baseline(clients, args.duration_s, model, args.long_every, "encode_batch_fast")
    cells += bench_service([int(p) for p in args.pools.split(",")], clients, args.duration_s, model,
                           args.long_every)
    segment_rows = bench_segment_cache(model)
    print("\nsegment cache (in-process CPU per chat encode):")
    for row in segment_rows:
        print(f"  system prompt {row['system_tokens']:>5} tokens: whole prompt {row['whole_prompt_us']:8.0f} us, "
              f"segment-cached {row['segment_cached_us']:6.0f} us ({row['speedup']:.1f}x)")
    scaling = _scaling(cells)
    for clients_n, ratio in scaling.items():
        print(f"pool 2 / pool 1 throughput at {clients_n} clients: {ratio:.2f}x (target >= 1.6x)")
    for cell in (c for c in cells if c.system == "service"):
        print(f"pool {cell.pool}, {cell.clients:>2} clients: {cell.tokens_per_s / cell.service_cpu_cores:>10,.0f} "
              f"tokens per service CPU-second ({cell.service_cpu_cores:.2f} cores obtained)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer_pool.json").write_text(json.dumps({
        "cpu_cores": os.cpu_count(), "load_average_after": os.getloadavg(), "duration_s": args.duration_s,
        "long_every": args.long_every, "cells": [asdict(c) for c in cells], "pool2_over_pool1": scaling,
        "segment_cache": segment_rows}, indent=2))
    plot(cells, out / "tokenizer_pool.png")
    print(f"wrote {out / 'tokenizer_pool.json'} and {out / 'tokenizer_pool.png'}")


def _scaling(cells: list[Cell]) -> dict[int, float]:
    by = {(c.pool, c.clients): c.tokens_per_s for c in cells if c.system == "service"}
    return {n: by[(2, n)] / by[(1, n)] for (pool, n) in by if pool == 1 and (2, n) in by}


if __name__ == "__main__":
    main()
