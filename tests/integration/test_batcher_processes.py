"""`python -m batcher` as real processes: kill -9 mid-stream and SIGTERM drain lose nothing
and duplicate nothing. The test plays the gateway and the worker through batcher.harness."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import queue_harness as h

from llmserve.protocol import keys

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def start(redis_url: str, consumer: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "batcher", "--redis-url", redis_url, "--models", h.MODEL,
           "--consumer", consumer, "--max-batch", "8", "--max-wait-ms", "5", "--reclaim-interval-ms", "100",
           "--workers-poll-ms", "20", "--heartbeat-ttl-ms", "500", "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_until(fn, timeout: float = 20.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while not (value := fn()):
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def consumers(client) -> dict[str, int]:
    """Consumer name -> pending count on the normal-priority work stream."""
    stream = keys.work_stream(h.MODEL, 2)
    if not client.exists(stream):
        return {}
    return {c["name"].decode(): c["pending"] for c in client.xinfo_consumers(stream, keys.WORK_GROUP)}


def wait_ready(client, proc: subprocess.Popen, consumer: str) -> None:
    def ready():
        assert proc.poll() is None, proc.stderr.read().decode()
        return consumer in consumers(client)
    wait_until(ready, what=f"{consumer} reading")


def test_kill_9_mid_stream_every_item_dispatched_exactly_once(redis_url, clean_redis):
    h.heartbeat(clean_redis, "w")
    procs = [start(redis_url, name, "--claim-idle-ms", "1000") for name in ("b1", "b2")]
    try:
        for proc, name in zip(procs, ("b1", "b2")):
            wait_ready(clean_redis, proc, name)
        items = [h.make_item(f"r{i}", tenant=f"t{i % 7}") for i in range(3000)]
        seen: list[str] = []

        def drain_inbox(beat: bool = True):
            if beat:
                h.heartbeat(clean_redis, "w")
            seen.extend(i.request_id for _, b in h.read_inbox(clean_redis, "w") for i in b.items)

        for n in range(0, 1500, 50):
            h.enqueue(clean_redis, *items[n:n + 50])
            drain_inbox()
            time.sleep(0.01)
        # Let the worker fall silent so b1 surely holds items, then kill it mid-stream.
        time.sleep(0.7)  # past --heartbeat-ttl-ms: no dispatch, arriving items are held
        n = 1500
        while consumers(clean_redis).get("b1", 0) == 0 and n < 1700:
            h.enqueue(clean_redis, *items[n:n + 10])  # whichever replica is blocked reading gets them
            n += 10
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        held_by_dead = consumers(clean_redis)["b1"]
        for n in range(n, 3000, 50):  # noqa: B020 - continue counting from where the loop above stopped
            h.enqueue(clean_redis, *items[n:n + 50])
            drain_inbox()
            time.sleep(0.01)
        wait_until(lambda: (drain_inbox(), len(seen) >= 3000)[1], 30, "all 3000 items dispatched")
        time.sleep(1.5)  # past another claim-idle period: a duplicate would appear now
        drain_inbox()
        dupes = [r for r, n in collections.Counter(seen).items() if n > 1]
        assert held_by_dead > 0
        assert dupes == [] and sorted(seen) == sorted(i.request_id for i in items)
        assert h.pending_work(clean_redis) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_sigterm_stops_cleanly_and_leaves_held_items_to_another_replica(redis_url, clean_redis):
    # Room for 5 items (2 blocks each) and a long capacity grace: b1 must hold the other 15.
    h.heartbeat(clean_redis, "w", free_blocks=10, total_blocks=100)
    b1 = start(redis_url, "b1", "--claim-idle-ms", "5000", "--capacity-grace-ms", "600000", "--grace-s", "1",
               "--heartbeat-ttl-ms", "600000")
    b2 = None
    try:
        wait_ready(clean_redis, b1, "b1")
        items = [h.make_item(f"r{i}", prompt_len=16, max_new_tokens=16) for i in range(20)]
        h.enqueue(clean_redis, *items)
        first = wait_until(lambda: h.peek_inbox(clean_redis, "w"), what="first batch")
        wait_until(lambda: consumers(clean_redis).get("b1") == 15, what="b1 holding 15")
        b1.send_signal(signal.SIGTERM)
        assert b1.wait(timeout=30) == 0
        dispatched = [i.request_id for b in h.peek_inbox(clean_redis, "w") for i in b.items]
        assert len(dispatched) == 5 and len(first) == 1
        assert consumers(clean_redis)["b1"] == 15  # still pending: nothing lost, nothing half-sent
        b2 = start(redis_url, "b2", "--claim-idle-ms", "5000", "--heartbeat-ttl-ms", "600000")
        h.heartbeat(clean_redis, "w", free_blocks=1000, total_blocks=1000)
        wait_until(lambda: sum(len(b.items) for b in h.peek_inbox(clean_redis, "w")) >= 20, 20,
                   "released items dispatched by b2")
        time.sleep(0.5)
        all_ids = [i.request_id for b in h.peek_inbox(clean_redis, "w") for i in b.items]
        assert sorted(all_ids) == sorted(i.request_id for i in items)
        assert h.pending_work(clean_redis) == 0
        assert b2.poll() is None
        b2.send_signal(signal.SIGTERM)
        assert b2.wait(timeout=30) == 0
    finally:
        for proc in (b1, b2):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
