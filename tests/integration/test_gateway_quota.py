"""The quota Lua scripts against a real Valkey: GCRA bound, max_concurrent, lease
expiry after kill -9, exact token reservations and refunds. Callers run in
separate OS processes, like gateway replicas sharing one Redis."""

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gateway.quota import Limits, Quota, tenant_keys
from llmserve.runtime import redis_client

REPO = Path(__file__).resolve().parents[2]

# One admission-client process: N async callers hammer admit() until the window ends.
CALLERS = textwrap.dedent("""
    import asyncio, json, sys, time, uuid
    from gateway.quota import Limits, Quota
    from llmserve.runtime import redis_client

    url, tenant, rps, burst, maxc, callers, window_s, hold_s, start_at = sys.argv[1:10]
    limits = Limits(tenant, float(rps), int(burst), 10**9, int(maxc))

    async def caller(quota, r, stats, end):
        while time.time() < end:
            rid = uuid.uuid4().hex
            d = await quota.admit(limits, rid, 1)
            if not d.admitted:
                stats["denied"][d.limit] = stats["denied"].get(d.limit, 0) + 1
                await asyncio.sleep(min(d.retry_after_ms, 50) / 1000)
                continue
            stats["admitted"] += 1
            stats["peak"] = max(stats["peak"], await r.incr("probe:inflight:" + tenant))
            await asyncio.sleep(float(hold_s))
            await r.decr("probe:inflight:" + tenant)
            await quota.release(limits, rid, 1)

    async def main():
        r = redis_client.connect(url)
        quota = Quota(r, lease_ttl_s=30)
        stats = {"admitted": 0, "peak": 0, "denied": {}}
        await asyncio.sleep(max(0.0, float(start_at) - time.time()))
        end = time.time() + float(window_s)  # a late-starting process still gets its whole window
        await asyncio.gather(*(caller(quota, r, stats, end) for _ in range(int(callers))))
        print(json.dumps(stats))

    asyncio.run(main())
""")

# Takes `n` leases with a short TTL, says so, then waits to be killed.
HOLDER = textwrap.dedent("""
    import asyncio, sys
    from gateway.quota import Limits, Quota
    from llmserve.runtime import redis_client

    url, tenant, n, ttl = sys.argv[1:5]
    async def main():
        quota = Quota(redis_client.connect(url), lease_ttl_s=float(ttl))
        limits = Limits(tenant, 1000.0, 1000, 10**9, int(n))
        for i in range(int(n)):
            assert (await quota.admit(limits, f"held-{i}", 1)).admitted
        print("held", flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def run_callers(redis_url, tenant, rps, burst, maxc, window_s, hold_s, processes=3, callers=(22, 21, 21)):
    start_at = time.time() + 1.5  # every process starts hammering at the same instant
    procs = [subprocess.Popen([sys.executable, "-c", CALLERS, redis_url, tenant, str(rps), str(burst), str(maxc),
                               str(n), str(window_s), str(hold_s), str(start_at)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in callers[:processes]]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    return results, start_at


@pytest.fixture
async def quota(redis_url, clean_redis):
    client = redis_client.connect(redis_url)
    yield Quota(client, lease_ttl_s=30)
    await client.aclose()


async def test_gcra_burst_then_rate(quota):
    limits = Limits("gcra", requests_per_second=0.5, burst=3, tokens_per_minute=60, max_concurrent=100)
    decisions = [await quota.admit(limits, f"r{i}", 1) for i in range(4)]
    assert [d.admitted for d in decisions] == [True, True, True, False]
    assert [d.remaining_requests for d in decisions[:3]] == [2, 1, 0]
    assert decisions[3].limit == "requests_per_second"
    assert 0 < decisions[3].retry_after_ms <= 2000          # one emission interval at most
    assert await quota.peek(limits) == (0, 57)                 # 1 token/s refill: not a whole one yet


async def test_tokens_limit_names_limit_and_retry(quota):
    limits = Limits("tok", requests_per_second=100, burst=100, tokens_per_minute=100, max_concurrent=100)
    assert (await quota.admit(limits, "a", 60)).admitted
    d = await quota.admit(limits, "b", 60)
    assert (d.admitted, d.limit) == (False, "tokens_per_minute")
    assert 10_000 < d.retry_after_ms <= 12_000               # 20 tokens at 100/min, minus what refilled
    assert await quota.release(limits, "a", 10) == 50        # refund makes room at once
    assert (await quota.admit(limits, "b", 60)).admitted


async def test_two_step_admission_reserves_tokens_after_the_lease(quota):
    """admit(cost 0) takes rate and lease; reserve() adds the counted tokens; release refunds them."""
    limits = Limits("two", requests_per_second=100, burst=100, tokens_per_minute=100, max_concurrent=1)
    first = await quota.admit(limits, "a", 0)
    assert first.admitted and first.remaining_tokens == 100
    assert (await quota.admit(limits, "b", 0)).limit == "max_concurrent"   # the lease is held already
    reserved = await quota.reserve(limits, "a", 70)
    assert (reserved.admitted, reserved.remaining_tokens) == (True, 30)
    assert await quota.ledger("two") == (70, 0)
    assert await quota.release(limits, "a", 20) == 50
    assert (await quota.admit(limits, "c", 0)).admitted
    short = await quota.reserve(limits, "c", 90)
    assert (short.admitted, short.limit) == (False, "tokens_per_minute") and short.retry_after_ms > 0
    assert await quota.release(limits, "c", 0) == 0            # nothing was reserved: nothing to refund
    assert (await quota.reserve(limits, "c", 1)).limit == "lease_expired"


async def test_64_callers_3_processes_never_exceed_gcra(redis_url, clean_redis):
    rps, burst, window_s = 5, 10, 3.0
    results, start_at = run_callers(redis_url, "gcra64", rps, burst, 1000, window_s, 0.0)
    elapsed = time.time() - start_at
    admitted = sum(r["admitted"] for r in results)
    # GCRA: at most `burst` at once plus `rps` per second after; the window is at most `elapsed` long.
    assert burst <= admitted <= burst + int(rps * elapsed) + 1
    assert sum(r["denied"].get("requests_per_second", 0) for r in results) > 0


async def test_64_callers_3_processes_never_exceed_max_concurrent(redis_url, clean_redis):
    results, _ = run_callers(redis_url, "conc64", 10_000, 10_000, 4, 2.0, 0.02)
    peak = max(r["peak"] for r in results)
    assert 1 <= peak <= 4
    assert sum(r["admitted"] for r in results) > 4
    assert sum(r["denied"].get("max_concurrent", 0) for r in results) > 0
    assert clean_redis.zcard(tenant_keys("conc64")["leases"]) == 0   # every lease released


async def test_leases_expire_after_kill_9(redis_url, clean_redis, quota):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, redis_url, "crashy", "4", "1.5"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        limits = Limits("crashy", 1000.0, 1000, 10**9, 4)
        d = await quota.admit(limits, "after", 1)
        assert (d.admitted, d.limit) == (False, "max_concurrent")
        deadline = time.monotonic() + 15
        while not d.admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            d = await quota.admit(limits, "after", 1)
        assert d.admitted                                     # the dead holder's leases lapsed
        assert await quota.in_flight("crashy") == 1
        assert clean_redis.hkeys(tenant_keys("crashy")["reserved"]) == [b"after"]
    finally:
        holder.kill()


async def test_reservations_and_refunds_add_up_over_100_requests(quota, clean_redis):
    limits = Limits("ledger", requests_per_second=10_000, burst=10_000, tokens_per_minute=10**8, max_concurrent=200)
    reserved = refunded = 0
    ids = []
    for i in range(100):
        prompt, max_new, used_completion = 10 + i % 7, 50 + i, (i * 13) % (50 + i)
        rid = f"req-{i}"
        assert (await quota.admit(limits, rid, prompt + max_new)).admitted
        ids.append((rid, prompt + used_completion))
        reserved += prompt + max_new
        refunded += max_new - used_completion
    assert await quota.in_flight("ledger") == 100
    got = [await quota.release(limits, rid, used) for rid, used in ids]
    assert sum(got) == refunded
    assert await quota.ledger("ledger") == (reserved, refunded)
    assert [await quota.release(limits, rid, 0) for rid, _ in ids[:3]] == [-1, -1, -1]   # refund once only
    assert await quota.ledger("ledger") == (reserved, refunded)
    assert await quota.in_flight("ledger") == 0
    assert clean_redis.hlen(tenant_keys("ledger")["reserved"]) == 0
