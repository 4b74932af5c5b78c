"""Soak: steady closed-loop load for a while, sampling what must not grow.

Every few seconds it records, per service process, resident memory and open file
descriptors, and from Redis the memory used, the key count, the per-request keys
(`llmserve:{r:...}`) and how many of them have no TTL. After the load stops it
waits for the per-request keys to expire. `problems()` turns the samples into a
list of findings (empty = healthy):

    report = asyncio.run(soak(stack, SoakConfig(duration_s=60)))
    assert report.problems() == []
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field

import redis

from llmserve.loadgen.runner import RunSettings, open_channel, run_one
from llmserve.loadgen.stats import RequestResult, summarize
from llmserve.loadgen.workload import WorkloadConfig, parse_dist, workload_stream
from llmserve.v1 import inference_pb2_grpc

REQUEST_KEYS = "llmserve:{r:*"
MB = 1024 * 1024


@dataclass
class SoakConfig:
    duration_s: float = 60.0
    concurrency: int = 4
    sample_every_s: float = 5.0
    api_key: str = "dev-key"
    prompt_tokens: str = "uniform:8:48"
    output_tokens: str = "uniform:4:16"
    seed: int = 0
    warmup_fraction: float = 0.25      # samples before this share of the run are the baseline's warm-up
    expire_wait_s: float = 60.0        # how long to wait for per-request keys to expire after the load
    rss_slack_mb: float = 64.0         # allowed RSS growth per process: max(slack, share of baseline)
    rss_slack_share: float = 0.20
    fd_slack: int = 16
    redis_memory_slack_mb: float = 16.0


@dataclass
class Sample:
    t_s: float
    rss_bytes: dict[str, int]
    fds: dict[str, int]
    redis_used_memory: int
    redis_keys: int
    request_keys: int
    request_keys_without_ttl: int


@dataclass
class SoakReport:
    config: SoakConfig
    samples: list[Sample]
    summary: dict
    before: Sample                       # before any load
    after_expiry: Sample                 # after the load stopped and the per-request keys had time to expire
    stream_lengths: dict[str, int] = field(default_factory=dict)   # work/inbox streams at the end

    def problems(self) -> list[str]:
        """What grew or leaked; empty when the run was healthy."""
        return [*self._errors(), *self._growth(), *self._redis()]

    def _errors(self) -> list[str]:
        bad = {c: n for c, n in self.summary["codes"].items() if c != "OK"}
        return [f"failed requests under moderate load: {bad}"] if bad else []

    def _baseline(self) -> Sample:
        index = min(int(len(self.samples) * self.config.warmup_fraction), len(self.samples) - 1)
        return self.samples[index]

    def _growth(self) -> list[str]:
        base, last, c = self._baseline(), self.samples[-1], self.config
        out = []
        for name, rss in last.rss_bytes.items():
            allowed = max(c.rss_slack_mb * MB, c.rss_slack_share * base.rss_bytes.get(name, rss))
            if rss - base.rss_bytes.get(name, rss) > allowed:
                out.append(f"{name}: RSS grew {(rss - base.rss_bytes[name]) / MB:.1f} MB "
                           f"(from {base.rss_bytes[name] / MB:.1f} MB)")
        for name, fds in last.fds.items():
            if fds - base.fds.get(name, fds) > c.fd_slack:
                out.append(f"{name}: open fds grew from {base.fds[name]} to {fds}")
        return out

    def _redis(self) -> list[str]:
        out = [f"{s.request_keys_without_ttl} per-request keys without a TTL at t={s.t_s:.0f}s"
               for s in self.samples if s.request_keys_without_ttl]
        if self.after_expiry.request_keys:
            out.append(f"{self.after_expiry.request_keys} per-request keys left after the TTL passed")
        grown = self.after_expiry.redis_used_memory - self.before.redis_used_memory
        if grown > self.config.redis_memory_slack_mb * MB:
            out.append(f"Redis memory grew {grown / MB:.1f} MB after the per-request keys expired")
        out += [f"stream {k} still holds {n} entries" for k, n in self.stream_lengths.items() if n]
        return out

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "summary": self.summary, "before": asdict(self.before),
                "after_expiry": asdict(self.after_expiry), "samples": [asdict(s) for s in self.samples],
                "stream_lengths": self.stream_lengths, "problems": self.problems()}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def take_sample(stack, client: redis.Redis, t_s: float) -> Sample:
    """One snapshot of every live service process and of Redis."""
    procs = {name: s.process.pid for name, s in stack.services.items() if s.alive()}
    request_keys = list(client.scan_iter(match=REQUEST_KEYS, count=1000))
    pipe = client.pipeline(transaction=False)
    for key in request_keys:
        pipe.ttl(key)
    ttls = pipe.execute() if request_keys else []
    return Sample(t_s=t_s, rss_bytes={n: rss_bytes(p) for n, p in procs.items()},
                  fds={n: open_fds(p) for n, p in procs.items()},
                  redis_used_memory=int(client.info("memory")["used_memory"]), redis_keys=client.dbsize(),
                  request_keys=len(request_keys), request_keys_without_ttl=sum(t == -1 for t in ttls))


def stream_lengths(client: redis.Redis) -> dict[str, int]:
    """XLEN of every work and inbox stream."""
    keys = [k.decode() for k in client.scan_iter(match="llmserve:{m:*", count=1000)]
    return {k: client.xlen(k) for k in keys if k.rsplit(":", 2)[-2] in ("work", "inbox")}


async def _drive(config: SoakConfig, settings: RunSettings, until: float) -> list[RequestResult]:
    specs = workload_stream(WorkloadConfig(requests=0, prompt_tokens=parse_dist(config.prompt_tokens),
                                           output_tokens=parse_dist(config.output_tokens),
                                           api_keys=[config.api_key], seed=config.seed))
    results: list[RequestResult] = []

    async def client(stub) -> None:
        while time.monotonic() < until:
            results.append(await run_one(stub, next(specs), settings))

    async with open_channel(settings) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(config.concurrency)))
    return results


async def _sampler(stack, client: redis.Redis, start: float, until: float, every_s: float,
                   samples: list[Sample]) -> None:
    while True:
        now = time.monotonic()
        samples.append(await asyncio.to_thread(take_sample, stack, client, now - start))
        if now >= until:
            return
        await asyncio.sleep(min(every_s, max(0.0, until - now)))


async def _await_expiry(stack, client: redis.Redis, start: float, timeout_s: float) -> Sample:
    deadline = time.monotonic() + timeout_s
    while True:
        sample = await asyncio.to_thread(take_sample, stack, client, time.monotonic() - start)
        if sample.request_keys == 0 or time.monotonic() > deadline:
            return sample
        await asyncio.sleep(1.0)


async def soak(stack, config: SoakConfig, settings: RunSettings | None = None) -> SoakReport:
    """Run the load against `stack` (a llmserve.local.stack.Stack) and sample it; see the module docstring."""
    settings = settings or RunSettings(target=stack.gateway_target, temperature=1.0, timeout_s=120.0)
    client = redis.Redis.from_url(stack.redis_url)
    try:
        start = time.monotonic()
        before = await asyncio.to_thread(take_sample, stack, client, 0.0)
        until = start + config.duration_s
        samples: list[Sample] = []
        results, _ = await asyncio.gather(_drive(config, settings, until),
                                          _sampler(stack, client, start, until, config.sample_every_s, samples))
        wall = time.monotonic() - start
        after = await _await_expiry(stack, client, start, config.expire_wait_s)
        streams = await asyncio.to_thread(stream_lengths, client)
    finally:
        client.close()
    return SoakReport(config=config, samples=samples, summary=summarize(results, wall), before=before,
                      after_expiry=after, stream_lengths=streams)
