"""Scheduling bench on the real stack (Valkey, tokenizer_svc, batcher, one gpu_worker on
SmolLM2-135M, gateway; all started as processes, as `llmserve up` does), each figure beside
the same run with the feature off:

  a  HIGH TTFT while --lows LOW generations of --low-tokens tokens fill the worker
     (max_running = --lows): priority preemption on vs off (worker --priority-preemption);
     beside it one decode step (the LOWs' median inter-token gap) and the HIGH prompt's TTFT
     on an idle stack (its prefill)
  b  two tenants of back-to-back clients (--long-clients, --short-clients: enough that both
     always have work waiting at the batcher, sampled from the work stream), one with
     --long-prompt-token prompts (the issue's 2,000) and one with --short-prompt (50), 4 new
     tokens each; over a --duration s window opening --settle s after both first had work
     waiting: prompt + generated tokens per second each tenant got and Jain's index,
     token-fair (VTC, batcher and worker) vs request round-robin (batcher and worker
     --fair-share requests)
  c  mixed SLO load (--slo-rate, --slo-duration s, after an unmeasured warm-up): 70 %
     interactive (50-token prompts, 8 new, TTFT 4 s, TPOT 1.5 s), 30 % batch (300-token
     prompts, 16 new, TTFT 40 s, TPOT 3 s); goodput (requests/s within their own targets)
     with the targets sent (earliest deadline first) and early refusal (tenant
     shed_unmeetable), vs the same requests without targets (FIFO). The targets and the rate
     (about the stack's capacity) suit a shared 2-core CPU; scale them with the machine.

    PYTHONPATH=$PWD .venv/bin/python bench/scheduling.py [--parts a,b,c] \\
        [--output bench/results/scheduling/cpu.json]
    PYTHONPATH=$PWD .venv/bin/python bench/scheduling_engine.py     # the in-process part (seconds)

Prints the figures; writes them, the CPU and the load average to --output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from gateway.tenants import hash_key  # noqa: E402
from llmserve.catalog import model_store  # noqa: E402
from llmserve.loadgen.goodput import jain, met  # noqa: E402
from llmserve.loadgen.stats import RequestResult  # noqa: E402
from llmserve.local.stack import Stack, StackConfig  # noqa: E402
from llmserve.protocol import keys, queue  # noqa: E402
from llmserve.protocol.slo import Targets  # noqa: E402
from llmserve.v1 import inference_pb2 as pb  # noqa: E402
from llmserve.v1 import inference_pb2_grpc, queue_pb2  # noqa: E402
from tokenizer_svc.loader import load_tokenizer  # noqa: E402

TENANTS = {"low": "low", "high": "high", "long": "normal", "short": "normal", "slo": "normal", "fifo": "normal"}
WORDS = ("river stone light cloud paper window garden music orange silver forest market letter winter "
         "engine planet bridge castle doctor island yellow summer number little people mother animal").split()
# part c: prompt tokens, max_new_tokens, targets
MIXED = {"interactive": (50, 8, Targets(4000, 1500)), "batch": (300, 16, Targets(40_000, 3000))}


def tenants_yaml() -> str:
    lines = ["tenants:"]
    for tenant, priority in TENANTS.items():
        lines.append(f"  - {{id: {tenant}, api_keys: ['sha256:{hash_key(tenant + '-key')}'], "
                     f"requests_per_second: 1000, burst: 1000, tokens_per_minute: 1000000000, "
                     f"max_concurrent: 10000, max_new_tokens: 1024, priority: {priority}, models: ['*'], "
                     f"shed_unmeetable: {'true' if tenant == 'slo' else 'false'}}}")
    return "\n".join(lines) + "\n"


class Prompts:
    """Distinct prompts of an exact token count (no prefix-cache hits between requests)."""

    def __init__(self, seed: int) -> None:
        self.tokenizer = load_tokenizer(model_store.fetch())
        self.rng = random.Random(seed)

    def make(self, tokens: int) -> str:
        words = " ".join(self.rng.choice(WORDS) for _ in range(tokens + 8))
        return self.tokenizer.decode(self.tokenizer.encode(words)[:tokens])


# ── one request ──────────────────────────────────────────────────────────────────────────────
async def stream(stub, tenant: str, prompt: str, max_new: int, request_id: str, slo: Targets | None = None,
                 priority: int = pb.PRIORITY_UNSPECIFIED, into: list | None = None) -> RequestResult:
    """One streaming Generate (greedy, to max_new tokens), timed chunk by chunk at the client; the
    result is also appended to `into` at once, so a cancelled stream's progress stays readable."""
    request = pb.GenerateRequest(prompt=prompt, request_id=request_id, priority=priority, sampling=pb.SamplingParams(
        temperature=0.0, max_new_tokens=max_new, ignore_eos=True))
    if slo is not None:
        request.slo_ttft_ms, request.slo_tpot_ms = slo.ttft_ms, slo.tpot_ms
    start = time.monotonic()
    result = RequestResult(tenant=list(TENANTS).index(tenant), code="OK", start_s=start, end_s=start)
    if into is not None:
        into.append(result)
    try:
        async for chunk in stub.Generate(request, metadata=(("authorization", f"Bearer {tenant}-key"),),
                                         timeout=900):
            now = time.monotonic()
            if chunk.token_ids:
                result.first_token_s = result.first_token_s or now
                result.chunk_times_s.append(now)
                result.chunk_tokens.append(len(chunk.token_ids))
            if chunk.HasField("usage"):
                result.prompt_tokens = chunk.usage.prompt_tokens
    except grpc.aio.AioRpcError as exc:
        result.code, result.message = exc.code().name, exc.details() or ""
    result.end_s = time.monotonic()
    return result


class Bench:
    """One started stack: its gateway stub, its Redis, and a wait for an idle worker."""

    def __init__(self, stack: Stack, prompts: Prompts) -> None:
        self.stack, self.prompts = stack, prompts
        self.redis = redis.Redis.from_url(stack.redis_url)
        self.channel = grpc.aio.insecure_channel(stack.gateway_target)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.ids = (f"r{n}" for n in range(10**9))

    async def idle(self, timeout_s: float = 900.0) -> None:
        """Until nothing is queued and the worker runs nothing (after a run's cancellations)."""
        model = model_store.DEFAULT_MODEL
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            queued = sum(self.redis.xlen(keys.work_stream(model, p)) for p in keys.PRIORITY_ORDER)
            beats = [queue_pb2.WorkerHeartbeat.FromString(v) for v in self.redis.hgetall(
                keys.workers_hash(model)).values()]
            if not queued and beats and all(b.running == 0 and b.waiting == 0 for b in beats):
                return
            await asyncio.sleep(0.5)
        raise TimeoutError("the stack did not go idle")

    async def cancel(self, tenant: str, request_ids: list[str]) -> None:
        metadata = (("authorization", f"Bearer {tenant}-key"),)
        await asyncio.gather(*(self.stub.Cancel(pb.CancelRequest(request_id=r), metadata=metadata, timeout=30)
                               for r in request_ids), return_exceptions=True)

    async def open_loop(self, rate: float, duration_s: float, send: Callable[[int], asyncio.Future]) -> tuple:
        """Poisson arrivals at `rate`/s for `duration_s`; returns (results finished in the window,
        number sent); whatever is still running at the end is cancelled."""
        rng, tasks, at = random.Random(7), [], 0.0
        start = time.monotonic()
        while (at := at + rng.expovariate(rate)) < duration_s:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.ensure_future(send(len(tasks))))
        await asyncio.sleep(max(0.0, start + duration_s - time.monotonic()))
        done = [t.result() for t in tasks if t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return done, len(tasks)

    # ── a: HIGH under a LOW flood ────────────────────────────────────────────────────────────
    async def high_under_lows(self, lows: int, low_tokens: int) -> dict:
        alone = await stream(self.stub, "high", self.prompts.make(32), 4, next(self.ids), priority=pb.PRIORITY_HIGH)
        low_ids = [next(self.ids) for _ in range(lows)]
        tasks = [asyncio.ensure_future(stream(self.stub, "low", self.prompts.make(32), low_tokens, rid,
                                              priority=pb.PRIORITY_LOW)) for rid in low_ids]
        low_results = await self._first_tokens(low_ids, tasks)
        await asyncio.sleep(2.0)                          # steady decode of every LOW
        high = await stream(self.stub, "high", self.prompts.make(32), 4, next(self.ids), priority=pb.PRIORITY_HIGH)
        await self.cancel("low", low_ids)
        finished = await asyncio.gather(*tasks)
        gaps = [b - a for r in finished for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])
                if a >= low_results and b <= high.start_s]
        await self.idle()
        return {"high_ttft_s": high.ttft_s, "high_code": high.code, "decode_step_s": statistics.median(gaps),
                "high_alone_ttft_s": alone.ttft_s, "lows": lows, "low_tokens": low_tokens,
                "lows_finished_before_high_token": sum(r.end_s < (high.first_token_s or 0) and r.output_tokens ==
                                                       low_tokens for r in finished)}

    async def _first_tokens(self, ids: list[str], tasks: list[asyncio.Future], timeout_s: float = 600.0) -> float:
        """Wait until every LOW stream is running (its first token arrived at the worker's heartbeat
        count); returns when that was."""
        model = model_store.DEFAULT_MODEL
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beats = [queue_pb2.WorkerHeartbeat.FromString(v) for v in self.redis.hgetall(
                keys.workers_hash(model)).values()]
            if beats and beats[0].running >= len(ids) and beats[0].waiting == 0:
                await asyncio.sleep(1.0)                  # their prefills are done by the next second
                return time.monotonic()
            if any(t.done() for t in tasks):
                raise RuntimeError(f"a LOW stream ended early: {[t.result() for t in tasks if t.done()][0]}")
            await asyncio.sleep(0.2)
        raise TimeoutError("the LOW generations did not all start")

    # ── b: two tenants, long vs short prompts, same request rate ─────────────────────────────
    async def fair_tokens(self, clients: dict[str, int], settle_s: float, duration_s: float, sizes: dict[str, int],
                          max_new: int = 4) -> dict:
        """`clients[t]` back-to-back clients per tenant, enough that both tenants' work waits at the
        batcher; the window of `duration_s` opens `settle_s` after both first have work queued there.
        Tokens each tenant got in the window: the prompt of every request whose first token arrived
        in it (its prefill is done), plus every generated token that arrived in it."""
        live: dict[str, list[RequestResult]] = {t: [] for t in sizes}
        stop = asyncio.Event()

        async def client(tenant: str) -> None:
            while not stop.is_set():
                await stream(self.stub, tenant, self.prompts.make(sizes[tenant]), max_new, next(self.ids),
                             into=live[tenant])

        tasks = [asyncio.ensure_future(client(t)) for t in sizes for _ in range(clients[t])]
        probe = Backlog(self.redis, list(sizes))
        probing = asyncio.ensure_future(probe.run(stop))
        try:
            async with asyncio.timeout(300):
                while not probe.both():
                    await asyncio.sleep(0.25)
            await asyncio.sleep(settle_s)
            probe.samples.clear()
            start = time.monotonic()
            await asyncio.sleep(duration_s)
            end = time.monotonic()
            samples = list(probe.samples)
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, probing, return_exceptions=True)
        await self.idle()
        tokens = {t: sum(_served(r, sizes[t], start, end) for r in rs) / duration_s for t, rs in live.items()}
        started = {t: sum(1 for r in rs if r.first_token_s is not None and start <= r.first_token_s <= end)
                   for t, rs in live.items()}
        return {"tokens_per_s": tokens, "first_tokens_in_window": started,
                "batcher_backlog_mean": {t: statistics.mean(b[t] for b in samples) for t in sizes},
                "both_backlogged_share": sum(all(b[t] for t in sizes) for b in samples) / len(samples),
                "errors": {t: sum(1 for r in rs if r.code not in ("OK", "CANCELLED")) for t, rs in live.items()},
                "jain": jain(list(tokens.values())), "clients_per_tenant": clients, "settle_s": settle_s,
                "duration_s": duration_s, "prompt_tokens": sizes, "max_new_tokens": max_new}

    # ── c: mixed SLO load ────────────────────────────────────────────────────────────────────
    async def mixed_slo(self, rate: float, duration_s: float, aware: bool) -> dict:
        kinds = random.Random(11)
        tenant = "slo" if aware else "fifo"

        async def one(kind: str, size: int, max_new: int, targets: Targets) -> tuple[str, RequestResult]:
            result = await stream(self.stub, tenant, self.prompts.make(size), max_new, next(self.ids),
                                  targets if aware else None)
            return kind, result

        def send(_n: int) -> asyncio.Future:
            kind = "interactive" if kinds.random() < 0.7 else "batch"
            return asyncio.ensure_future(one(kind, *MIXED[kind]))

        for size, max_new, _ in MIXED.values():          # warm up, unmeasured (no targets: no samples)
            await stream(self.stub, "fifo", self.prompts.make(size), max_new, next(self.ids))
        done, sent = await self.open_loop(rate, duration_s, send)
        await self.idle()
        met_by_kind = {k: sum(met(r, MIXED[k][2]) for kind, r in done if kind == k) for k in MIXED}
        return {"goodput_per_s": sum(met_by_kind.values()) / duration_s, "met": met_by_kind, "sent": sent,
                "finished": sum(1 for _, r in done if r.ok),
                "refused_early": sum(1 for _, r in done if r.code == "RESOURCE_EXHAUSTED"),
                "rate": rate, "duration_s": duration_s}


class Backlog:
    """How many requests of each tenant wait at the batcher, every 0.5 s: entries of the NORMAL
    work stream (read ahead or not; the batcher deletes an entry once it dispatched it)."""

    def __init__(self, client: redis.Redis, tenants: list[str]) -> None:
        self.redis, self.tenants = client, tenants
        self.key = keys.work_stream(model_store.DEFAULT_MODEL, pb.PRIORITY_NORMAL)
        self.samples: list[dict[str, int]] = []

    def both(self) -> bool:
        """Whether every tenant had work waiting at the last sample."""
        return bool(self.samples) and all(self.samples[-1].values())

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            entries = await asyncio.to_thread(self.redis.xrange, self.key)
            counts = dict.fromkeys(self.tenants, 0)
            for _, fields in entries:
                tenant = queue.decode_item(fields).tenant
                counts[tenant] = counts.get(tenant, 0) + 1
            self.samples.append(counts)
            await asyncio.sleep(0.5)


def _served(result: RequestResult, prompt_tokens: int, start: float, end: float) -> int:
    """Prompt (when its first token arrived) plus generated tokens a request got in [start, end]."""
    prompt = prompt_tokens if result.first_token_s is not None and start <= result.first_token_s <= end else 0
    return prompt + sum(n for t, n in zip(result.chunk_times_s, result.chunk_tokens) if start <= t <= end)


STACKS = {   # feature on / off: worker preemption (a), batcher fair share (b); c runs on "on" both ways
    "on": {},
    "off": {"gpu_worker": ["--priority-preemption", "false", "--fair-share", "requests"],
            "batcher": ["--fair-share", "requests"]},
}
# 256-token steps: a cancelled backlog's prefill chunks stop sooner between runs
COMMON_FLAGS = {"gpu_worker": ["--kv-cache-mb", "1200", "--max-batched-tokens", "256"],
                "gateway": ["--queue-max-depth", "100000", "--detach-grace-s", "0.2", "--max-queue-wait-s", "900"]}


def start_stack(setting: str, state: Path) -> Stack:
    tenants = state / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    flags = {name: COMMON_FLAGS.get(name, []) + STACKS[setting].get(name, []) for name in
             ("gpu_worker", "batcher", "gateway")}
    config = StackConfig(workers=1, device="cpu", port=0, http_port=0, tenants=tenants, extra_flags=flags,
                         log_dir=state / setting)
    return Stack(config).start()


async def run_parts(setting: str, parts: set[str], args: argparse.Namespace, prompts: Prompts, state: Path) -> dict:
    stack = start_stack(setting, state)
    bench = Bench(stack, prompts)
    out: dict = {}
    try:
        if "a" in parts:
            out["a"] = await bench.high_under_lows(args.lows, args.low_tokens)
            print(f"[{setting}] a: {out['a']}", flush=True)
        if "b" in parts:
            out["b"] = await bench.fair_tokens({"long": args.long_clients, "short": args.short_clients}, args.settle,
                                               args.duration, {"long": args.long_prompt, "short": args.short_prompt})
            print(f"[{setting}] b: {out['b']}", flush=True)
        if "c" in parts and setting == "on":
            for aware in (True, False):
                out["c_slo_aware" if aware else "c_fifo"] = await bench.mixed_slo(args.slo_rate, args.slo_duration,
                                                                                  aware)
                print(f"[{setting}] c aware={aware}: {out['c_slo_aware' if aware else 'c_fifo']}", flush=True)
    finally:
        await bench.channel.close()
        stack.close()
    return out


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


async def run(args: argparse.Namespace) -> None:
    parts = set(args.parts.split(","))
    prompts = Prompts(seed=0)
    report: dict = {"machine": machine(), "loadavg_before": os.getloadavg(), "args": vars(args),
                    "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="sched-bench-") as tmp:
        for setting in STACKS:
            if setting == "off" and parts <= {"c"}:
                continue                                  # part c runs both ways on the "on" stack
            report[setting] = await run_parts(setting, parts, args, prompts, Path(tmp))
    report["loadavg_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="a,b,c")
    parser.add_argument("--lows", type=int, default=32)
    parser.add_argument("--low-tokens", type=int, default=512)
    parser.add_argument("--long-clients", type=int, default=12, help="back-to-back clients of part b's long tenant")
    parser.add_argument("--short-clients", type=int, default=40,
                        help="back-to-back clients of part b's short tenant (its requests finish sooner: it needs "
                             "more to keep work waiting at the batcher)")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds from both tenants' first backlog at the batcher to part b's window")
    parser.add_argument("--long-prompt", type=int, default=2000, help="prompt tokens of part b's long tenant")
    parser.add_argument("--short-prompt", type=int, default=50, help="prompt tokens of part b's short tenant")
    parser.add_argument("--slo-rate", type=float, default=2.5, help="requests/s in part c")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of part b's window")
    parser.add_argument("--slo-duration", type=float, default=40.0, help="seconds of load in part c")
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
