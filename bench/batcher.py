"""Batcher bench: items/s through enqueue -> batch -> inbox, and the latency it adds.

    .venv/bin/python bench/batcher.py [--items 20000] [--paced-s 5] [--max-wait-ms 5]

For max_batch 1, 8, 32 and 1 or 2 `python -m batcher` processes, against one
fresh valkey-server:
  * throughput: a producer process XADDs N items as fast as it can; a null
    worker process reads its inbox and XACKs at once; items/s = N / (last item
    in the inbox - first item enqueued);
  * added latency: the producer paces at half the 5,000 items/s target
    (2,500/s); latency = time in the inbox - time enqueued, p50/p99, compared with
    max_wait_ms (a batch may legitimately wait that long to fill).
Floor, same Valkey, same process layout: raw XADD + XREADGROUP + XACK.
Prints a table; writes bench/results/batcher.json and batcher.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]   # the queue harness lives with the tests

import queue_harness as h  # noqa: E402

from llmserve.local.valkey import ValkeyServer  # noqa: E402
from llmserve.protocol import keys, queue  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET_ITEMS_S = 5000
WORKER = "null-worker"
FLOOR_STREAM = "bench:floor"


# ── processes ──────────────────────────────────────────────────────────────

def producer(url: str, stream: str | None, n: int, rate: float | None, out: mp.Queue) -> None:
    """Enqueue n items (request_id carries the send time in ns); paced at `rate`/s if given."""
    client = redis.Redis.from_url(url)
    base = h.make_item("x", prompt_len=32, max_new_tokens=64)
    t0, sent = time.time(), 0
    chunk = 100 if rate is None else max(1, int(rate / 500))  # paced: one chunk per 2 ms
    while sent < n:
        if rate is not None:
            due = int((time.time() - t0) * rate) + 1
            if due <= sent:
                time.sleep(0.0005)
                continue
        pipe = client.pipeline(transaction=False)
        for i in range(sent, min(n, sent + chunk)):
            base.request_id = f"{i}:{time.time_ns()}"
            pipe.xadd(stream or keys.work_stream(h.MODEL, 2), queue.item_entry(base))
        pipe.execute()
        sent = min(n, sent + chunk)
    out.put({"t_first": t0})


def _heartbeats(url: str, stop: threading.Event) -> None:
    client = redis.Redis.from_url(url)
    while not stop.is_set():
        h.heartbeat(client, WORKER, free_blocks=10**8, max_running=10**8)
        stop.wait(0.2)


def null_worker(url: str, n: int, out: mp.Queue, floor: bool = False) -> None:
    """Read (the inbox, or the raw stream for the floor), XACK at once, record latency per item."""
    client = redis.Redis.from_url(url)
    stream, group = (FLOOR_STREAM, "floor") if floor else (keys.inbox_stream(h.MODEL, WORKER), keys.INBOX_GROUP)
    if not floor:
        h.ensure_inbox(client, WORKER)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeats, args=(url, stop), daemon=True)
    if not floor:
        beat.start()
    lat_ms, disp_ms, sizes, t_last, deadline = [], [], [], 0.0, time.time() + 120
    while len(lat_ms) < n and time.time() < deadline:
        reply = client.xreadgroup(group, WORKER, {stream: ">"}, count=200, block=200)
        now_ns = time.time_ns()
        ids = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                ids.append(entry_id)
                if floor:
                    items, created_ns = [queue.decode_item(fields)], now_ns
                else:
                    batch = queue.decode_batch(fields)
                    items, created_ns = list(batch.items), batch.created_unix_ms * 1_000_000
                sizes.append(len(items))
                sent_ns = [int(i.request_id.split(":")[1]) for i in items]
                lat_ms += [(now_ns - t) / 1e6 for t in sent_ns]
                disp_ms += [(created_ns - t) / 1e6 for t in sent_ns]
        if ids:
            client.xack(stream, group, *ids)
            t_last = time.time()
    stop.set()
    out.put({"lat_ms": lat_ms, "disp_ms": disp_ms, "sizes": sizes, "t_last": t_last})


# ── one measurement ────────────────────────────────────────────────────────

def run_flow(url: str, n: int, rate: float | None, floor: bool = False) -> dict:
    out_p, out_w = mp.Queue(), mp.Queue()
    worker = mp.Process(target=null_worker, args=(url, n, out_w, floor))
    worker.start()
    time.sleep(0.3)
    prod = mp.Process(target=producer, args=(url, FLOOR_STREAM if floor else None, n, rate, out_p))
    prod.start()
    t_first = out_p.get(timeout=180)["t_first"]
    res = out_w.get(timeout=180)
    prod.join()
    worker.join()
    lat, disp = sorted(res["lat_ms"]), sorted(res["disp_ms"])
    return {
        "dispatch_p50_ms": _pct(disp, 50), "dispatch_p99_ms": _pct(disp, 99),
        "items": len(lat), "items_s": len(lat) / max(1e-9, res["t_last"] - t_first),
        "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99),
        "mean_batch": statistics.fmean(res["sizes"]) if res["sizes"] else 0.0,
    }


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else float("nan")


def start_batchers(url: str, count: int, max_batch: int, max_wait_ms: float) -> list[subprocess.Popen]:
    procs = [subprocess.Popen(
        [sys.executable, "-m", "batcher", "--redis-url", url, "--models", h.MODEL, "--consumer", f"bench-b{i}",
         "--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms), "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.DEVNULL) for i in range(count)]
    client = redis.Redis.from_url(url)
    stream = keys.work_stream(h.MODEL, 2)
    deadline = time.time() + 30
    while time.time() < deadline:
        if client.exists(stream):
            names = {c["name"].decode() for c in client.xinfo_consumers(stream, keys.WORK_GROUP)}
            if len(names) == count:
                return procs
        time.sleep(0.05)
    raise RuntimeError("batchers did not start")


def stop_batchers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=30)


def measure_floor(server: ValkeyServer, n: int, paced_s: float) -> dict:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.xgroup_create(FLOOR_STREAM, "floor", id="0", mkstream=True)
    tput = run_flow(server.url, n, None, floor=True)
    client.flushall()
    client.xgroup_create(FLOOR_STREAM, "floor", id="0", mkstream=True)
    paced = run_flow(server.url, int(TARGET_ITEMS_S / 2 * paced_s), TARGET_ITEMS_S / 2, floor=True)
    return {"config": "floor: raw XADD+XREADGROUP+XACK", "items_s": tput["items_s"],
            "paced_p50_ms": paced["p50_ms"], "paced_p99_ms": paced["p99_ms"], "mean_batch": tput["mean_batch"]}


def measure(server: ValkeyServer, batchers: int, max_batch: int, max_wait_ms: float, n: int,
            paced_s: float) -> dict:
    redis.Redis.from_url(server.url).flushall()
    procs = start_batchers(server.url, batchers, max_batch, max_wait_ms)
    try:
        cpu0 = sum(_cpu_s(p.pid) for p in procs)
        tput = run_flow(server.url, n, None)
        cpu_us_per_item = (sum(_cpu_s(p.pid) for p in procs) - cpu0) / n * 1e6
        paced = run_flow(server.url, int(TARGET_ITEMS_S / 2 * paced_s), TARGET_ITEMS_S / 2)
    finally:
        stop_batchers(procs)
    return {"config": f"batchers={batchers} max_batch={max_batch}", "batchers": batchers, "max_batch": max_batch,
            "max_wait_ms": max_wait_ms, "items_s": tput["items_s"], "tput_p99_ms": tput["p99_ms"],
            "paced_p50_ms": paced["p50_ms"], "paced_p99_ms": paced["p99_ms"],
            "paced_dispatch_p50_ms": paced["dispatch_p50_ms"], "paced_dispatch_p99_ms": paced["dispatch_p99_ms"],
            "paced_items_s": paced["items_s"], "paced_mean_batch": paced["mean_batch"], "mean_batch": tput["mean_batch"],
            "batcher_cpu_us_per_item": cpu_us_per_item,
            "p99_within_target": paced["p99_ms"] < max_wait_ms + 5}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ── report ─────────────────────────────────────────────────────────────────

def print_table(rows: list[dict], max_wait_ms: float) -> None:
    print(f"\nitems/s: throughput run (cpu us/item: batcher processes' CPU per item in it); latency "
          f"(enqueue -> read from inbox; disp = enqueue -> batch created, ms resolution) at "
          f"{TARGET_ITEMS_S // 2} items/s paced; max_wait_ms={max_wait_ms}, target p99 < {max_wait_ms + 5} ms; "
          f"load average at end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'config':34} {'items/s':>8} {'cpu us/item':>11} {'batch':>6} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'p99-wait':>8} {'disp p50':>8} {'disp p99':>8}")
    for r in rows:
        batcher = "max_batch" in r
        nan = float("nan")
        print(f"{r['config'][:34]:34} {r['items_s']:8.0f} {r.get('batcher_cpu_us_per_item', nan):11.0f} "
              f"{r['mean_batch']:6.1f} {r['paced_p50_ms']:7.2f} {r['paced_p99_ms']:7.2f} "
              f"{r['paced_p99_ms'] - max_wait_ms if batcher else nan:8.2f} "
              f"{r.get('paced_dispatch_p50_ms', nan):8.2f} {r.get('paced_dispatch_p99_ms', nan):8.2f}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [r["config"].replace("floor: raw XADD+XREADGROUP+XACK", "floor").replace(" ", "\n") for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar(labels, [r["items_s"] for r in rows], color="tab:blue")
    ax1.axhline(TARGET_ITEMS_S, color="red", ls="--", label="target 5,000/s")
    ax1.set_ylabel("items/s")
    ax1.legend()
    ax1.tick_params(axis="x", labelsize=7)
    x = range(len(rows))
    ax2.bar([i - 0.2 for i in x], [r["paced_p50_ms"] for r in rows], 0.4, label="p50")
    ax2.bar([i + 0.2 for i in x], [r["paced_p99_ms"] for r in rows], 0.4, label="p99")
    ax2.set_xticks(list(x), labels, fontsize=7)
    ax2.set_ylabel("ms enqueue -> inbox at 2,500 items/s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=20000, help="items per throughput run")
    parser.add_argument("--paced-s", type=float, default=5.0, help="seconds per paced latency run")
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--max-batch", default="1,8,32")
    parser.add_argument("--batchers", default="1,2")
    args = parser.parse_args()
    server = ValkeyServer().start()
    try:
        rows = [measure_floor(server, args.items, args.paced_s)]
        for batchers in (int(b) for b in args.batchers.split(",")):
            for max_batch in (int(m) for m in args.max_batch.split(",")):
                rows.append(measure(server, batchers, max_batch, args.max_wait_ms, args.items, args.paced_s))
                print(f"  done: {rows[-1]['config']}: {rows[-1]['items_s']:.0f} items/s", flush=True)
    finally:
        server.close()
    print_table(rows, args.max_wait_ms)
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"cpus": os.cpu_count(), "note": "2 shared cores; valkey, batcher(s), producer and null worker "
            "all on the same machine", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (RESULTS / "batcher.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, RESULTS / "batcher.png")
    print(f"\nwrote {RESULTS / 'batcher.json'} and batcher.png")


if __name__ == "__main__":
    main()
