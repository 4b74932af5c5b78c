"""Admission-control cost: decisions/s and p50/p99 latency of the gateway's quota
check (gateway.quota.Quota.admit: one Lua round trip doing GCRA + token bucket
+ concurrency lease) from 1 and 3 processes, next to a plain Redis INCR round
trip (the floor) under the same load, against a real Valkey.

    .venv/bin/python bench/gateway_admission.py [--seconds 5] [--callers 8] [--json out.json]

Each process runs `--callers` asyncio callers in a closed loop; every admitted
request is released again (a second, untimed round trip) so leases never pile
up. Limits are set so high that every decision takes the full admit path. The
configs run in interleaved rounds and the median round (by decisions/s) is shown.
"server us/call" is Valkey's own time per EVALSHA (admit and release averaged)
or per INCR, from INFO commandstats: the part no client load can distort.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.quota import Limits, Quota  # noqa: E402
from llmserve.local.valkey import ValkeyServer  # noqa: E402
from llmserve.runtime import redis_client  # noqa: E402

LIMITS = Limits("bench", requests_per_second=1e7, burst=10**7, tokens_per_minute=10**12, max_concurrent=10**6)


async def _caller(op: str, quota: Quota, redis, end: float, lat: list[float]) -> int:
    n = 0
    while time.perf_counter() < end:
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        if op == "admit":
            decision = await quota.admit(LIMITS, rid, 300)
            lat.append(time.perf_counter() - t0)
            if decision.admitted:
                await quota.release(LIMITS, rid, 100)
        else:
            await redis.execute_command("INCR", "bench:incr")
            lat.append(time.perf_counter() - t0)
        n += 1
    return n


async def _child(url: str, op: str, callers: int, seconds: float, start_at: float) -> dict:
    redis = redis_client.connect(url, max_connections=callers + 4)
    quota = Quota(redis, lease_ttl_s=60)
    await quota.admit(LIMITS, "warmup", 1)        # loads the scripts
    await quota.release(LIMITS, "warmup", 1)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    end = time.perf_counter() + seconds
    lat: list[float] = []
    counts = await asyncio.gather(*(_caller(op, quota, redis, end, lat) for _ in range(callers)))
    await redis.aclose()
    return {"decisions": sum(counts), "latencies_ms": [x * 1000 for x in lat]}


def _server_usec_per_call(url: str, op: str) -> float:
    """Valkey's own time per command (INFO commandstats): the script's cost without client or network."""
    client = redis.Redis.from_url(url)
    stats = client.info("commandstats")
    client.close()
    return float(stats.get("cmdstat_" + ("evalsha" if op == "admit" else "incr"), {}).get("usec_per_call", 0.0))


def run(url: str, op: str, processes: int, callers: int, seconds: float) -> dict:
    reset = redis.Redis.from_url(url)
    reset.config_resetstat()
    reset.close()
    start_at = time.time() + 1.0
    procs = [subprocess.Popen([sys.executable, __file__, "--child", url, op, str(callers), str(seconds),
                               str(start_at)], stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    results = [json.loads(p.communicate()[0]) for p in procs]
    lat = sorted(x for r in results for x in r["latencies_ms"])
    return {"op": op, "processes": processes, "callers_per_process": callers,
            "per_s": sum(r["decisions"] for r in results) / seconds,
            "p50_ms": statistics.median(lat), "p99_ms": lat[int(len(lat) * 0.99) - 1],
            "server_usec_per_call": _server_usec_per_call(url, op)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        url, op, callers, seconds, start_at = argv[1:6]
        print(json.dumps(asyncio.run(_child(url, op, int(callers), float(seconds), float(start_at)))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--callers", type=int, default=8, help="concurrent callers per process")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median round is reported")
    parser.add_argument("--redis-url", default="", help="use this Redis instead of starting a Valkey")
    parser.add_argument("--json", default="", help="also write the rows here")
    args = parser.parse_args(argv)
    server = None if args.redis_url else ValkeyServer().start()
    url = args.redis_url or server.url
    try:
        configs = [(op, procs) for procs in (1, 3) for op in ("incr", "admit")]
        # Interleaved rounds: on a shared machine, background load then hits every config alike.
        rounds = [[run(url, op, procs, args.callers, args.seconds) for op, procs in configs]
                  for _ in range(args.rounds)]
        rows = [sorted((r[i] for r in rounds), key=lambda row: row["per_s"])[len(rounds) // 2]
                for i in range(len(configs))]
    finally:
        if server:
            server.close()
    print(f"{'check':<28}{'procs':>6}{'decisions/s':>14}{'p50 ms':>10}{'p99 ms':>10}{'server us/call':>16}")
    for r in rows:
        name = "Redis INCR (floor)" if r["op"] == "incr" else "quota admit (Lua)"
        print(f"{name:<28}{r['processes']:>6}{r['per_s']:>14.0f}{r['p50_ms']:>10.3f}{r['p99_ms']:>10.3f}"
              f"{r['server_usec_per_call']:>16.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
