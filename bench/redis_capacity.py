"""Redis capacity: commands and server time per request and per generated token, and the
shards a fleet needs.

    .venv/bin/python bench/redis_capacity.py [--requests 48] [--concurrency 8] [--max-new-tokens 32]
        [--workers 2] [--idle-s 10] [--tokens-per-s 2000] [--tokens-per-request 256] [--shard-busy 0.5]
    .venv/bin/python bench/redis_capacity.py --cluster 3     # the same load on a 3-master cluster

Runs the whole stack (`llmserve.local.stack.Stack`: tokenizer_svc, batcher, gpu_worker ×N on CPU,
gateway) on one fresh valkey-server, so every command of the fleet lands on one server:

  1. warm-up: one wave of requests (scripts loaded, connections open), not counted;
  2. idle: `--idle-s` seconds with no requests: the background (heartbeats, the batcher's
     polls, blocked reads that return empty), per worker-second;
  3. load: `--requests` greedy requests of `--max-new-tokens` tokens, `--concurrency` at once,
     through the client SDK.

For 2 and 3 it reads `INFO commandstats` (calls, usec), `INFO cpu` (the server process's CPU,
which adds socket I/O and parsing to the commands' own usec) and the SLOWLOG (threshold 0, so
every command with its key and client). The client's TCP port names the service (/proc), the
key's hash tag the family: {m:<model>} queue (work streams, inboxes, heartbeats), {r:<request>}
events/meta/epoch/cancel, {t:<tenant>} quota. Load minus the idle rate is what the requests
cost; it is split into admission, queueing, dispatch, completion (per request) and token writes
and reads (per generated token). From that and a stated fleet (tokens/s per worker, tokens per
request) it prints the shards needed for 100 and 1,000 workers, which family fills a shard
first, and how many queue cells (`queue_shards`, llmserve/protocol/keys.py) keep a model's queue slots
under the budget. Writes bench/results/redis_capacity.json.

With `--cluster N` the same load runs on an N-master Valkey Cluster (tests/cluster/valkey_cluster.py)
instead, and it prints what each node carried, by family, and which node holds the model's {m} tag
and the tenant's {t} tag: the hot-shard question measured directly (bench/results/redis_cluster.json).
`--queue-shards K` runs the stack with K queue cells, to see the {m} traffic split over K slots.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batcher import scripts as batcher_scripts  # noqa: E402
from gateway import quota  # noqa: E402
from llmserve.catalog import model_store  # noqa: E402
from llmserve.loadgen.streams import PROMPTS, StreamLoad  # noqa: E402
from llmserve.local.stack import Stack, StackConfig  # noqa: E402
from llmserve.local.valkey import ValkeyServer  # noqa: E402
from llmserve.protocol import keys  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FAMILY = re.compile(rb"\{([mrt]):")
# script bodies -> names, for EVALSHA (EVAL is named by its key count: fencing's two scripts)
SCRIPTS = {hashlib.sha1(body.encode()).hexdigest(): name for name, body in (
    ("admit", quota.ADMIT), ("release", quota.RELEASE), ("renew", quota.RENEW), ("peek", quota.PEEK),
    ("charge_request", quota.CHARGE_REQUEST), ("lease", quota.LEASE),
    ("dispatch", batcher_scripts._DISPATCH), ("touch", batcher_scripts._TOUCH))}
EVAL_BY_KEYS = {b"1": "raise_fence", b"3": "fenced_xadd"}
PER_REQUEST = ("admission", "queueing", "dispatch", "completion")
PER_TOKEN = ("token write", "token read")


# ── what the server saw ──────────────────────────────────────────────────────
@dataclass
class Window:
    seconds: float
    cpu_us: float                       # server process CPU (user + sys)
    stats: dict[str, dict]              # INFO commandstats
    rows: dict[tuple, list[float]]      # (service, family, name) -> [calls, usec]


def reset(client: redis.Redis) -> tuple[float, float]:
    client.config_resetstat()
    client.execute_command("SLOWLOG", "RESET")
    return time.monotonic(), cpu_us(client)


def cpu_us(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6


def collect(client: redis.Redis, started: tuple[float, float], owners: dict[int, str]) -> Window:
    seconds, cpu = time.monotonic() - started[0], cpu_us(client) - started[1]
    stats = client.info("commandstats")
    rows: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    for entry in top_level(client.execute_command("SLOWLOG", "GET", -1)):
        args, addr = entry[3], entry[4]
        name = command_name(args)
        if name.startswith(("slowlog", "config", "info")):
            continue                                             # the bench's own probes
        port = int(addr.rsplit(b":", 1)[1]) if addr else 0
        row = rows[(owners.get(port, "other"), family(args), name)]
        row[0] += 1
        row[1] += entry[2]
    return Window(seconds, cpu, stats, dict(rows))


def top_level(log: list) -> list:
    """The SLOWLOG without the commands scripts ran (it logs those too, just before their script,
    which already counts their time): the run of entries right before an EVAL/EVALSHA, from the
    same client, that touch only the script's KEYS or no key (TIME)."""
    out: list = []
    for entry in sorted(log, key=lambda e: e[0]):
        args = entry[3]
        if args[0].lower() in (b"eval", b"evalsha"):
            script_keys = set(args[3:3 + int(args[2])])
            expected_id = entry[0] - 1
            while out and out[-1][0] == expected_id and out[-1][4] == entry[4] \
                    and set(keys_of(out[-1][3])) <= script_keys:
                out.pop()
                expected_id -= 1
        out.append(entry)
    return out


def keys_of(args: list[bytes]) -> list[bytes]:
    return [a for a in args[1:] if a.startswith(b"llmserve:")]


def command_name(args: list[bytes]) -> str:
    head = args[0].lower()
    if head == b"evalsha":
        return SCRIPTS.get(args[1].decode(), "evalsha?")
    if head == b"eval":
        return EVAL_BY_KEYS.get(args[2], "eval?")
    if head in (b"xgroup", b"client", b"script", b"command", b"cluster", b"config", b"slowlog") and len(args) > 1:
        return f"{head.decode()} {args[1].lower().decode()}"
    return head.decode()


def family(args: list[bytes]) -> str:
    for arg in args[1:]:
        match = FAMILY.search(arg)
        if match:
            return "{" + match.group(1).decode() + "}"
    return "-"


def connection_owners(stack: Stack, redis_port: int) -> dict[int, str]:
    """Client-side TCP port -> service kind, for every connection to Redis that a service holds."""
    inode_port = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local, remote, inode = cols[1], cols[2], cols[9]
        if int(remote.split(":")[1], 16) == redis_port:
            inode_port[inode] = int(local.split(":")[1], 16)
    owners = {}
    for name, proc in stack.services.items():
        if not proc.alive():
            continue
        kind = name.split("-")[0]
        fd_dir = Path(f"/proc/{proc.process.pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                port = inode_port.get(target[8:-1])
                if port:
                    owners[port] = kind
    return owners


# ── attribution ──────────────────────────────────────────────────────────────
def phase(service: str, fam: str, name: str) -> str:
    """Which part of a request's life a command serves (rows the idle run explains are removed first)."""
    if fam == "{t}":
        return "completion" if name == "release" else "admission"
    if service == "gateway":
        return {"{m}": "queueing", "{r}": "token read" if name == "xread" else "admission"}.get(fam, "other")
    if service == "batcher":
        return "queueing" if name == "xreadgroup" else "dispatch" if fam in ("{m}", "{r}") else "other"
    if service == "gpu_worker":
        if fam == "{r}":
            return "token write"
        return {"xreadgroup": "dispatch", "xack": "completion", "xdel": "completion"}.get(name, "other")
    return "other"


def net_rows(load: Window, idle: Window, idle_workers: int, load_workers: int) -> dict[tuple, list[float]]:
    """Load minus what the idle rate explains over the load's duration."""
    scale = load.seconds / idle.seconds * load_workers / idle_workers
    out = {}
    for key, (calls, usec) in load.rows.items():
        base_calls, base_usec = idle.rows.get(key, (0, 0.0))
        out[key] = [max(0.0, calls - base_calls * scale), max(0.0, usec - base_usec * scale)]
    return out


# ── the run ──────────────────────────────────────────────────────────────────
def run_load(target: str, requests: int, concurrency: int, max_new_tokens: int, tag: str) -> tuple[int, int]:
    done = tokens = 0
    while done < requests:
        n = min(concurrency, requests - done)
        prompts = [PROMPTS[(done + i) % len(PROMPTS)] for i in range(n)]
        records = StreamLoad(target, "dev-key", prompts, max_new_tokens=max_new_tokens).run(f"{tag}-{done}")
        failed = [r.request_id for r in records if r.error]
        assert not failed, f"requests failed: {failed}"
        tokens += sum(len(r.token_ids) for r in records)
        done += n
    return done, tokens


def measure(args) -> dict:
    valkey = ValkeyServer().start()
    client = redis.Redis(host="127.0.0.1", port=valkey.port)
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 2_000_000)
    stack = Stack(StackConfig(workers=args.workers, device="cpu", port=0, redis_url=valkey.url))
    try:
        stack.start()
        run_load(stack.gateway_target, args.concurrency, args.concurrency, args.max_new_tokens, "warm")
        started = reset(client)
        time.sleep(args.idle_s)
        idle = collect(client, started, connection_owners(stack, valkey.port))
        started = reset(client)
        requests, tokens = run_load(stack.gateway_target, args.requests, args.concurrency, args.max_new_tokens, "load")
        load = collect(client, started, connection_owners(stack, valkey.port))
    finally:
        stack.close()
        valkey.close()
    return report(args, idle, load, requests, tokens)


def measure_cluster(args) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "cluster"))
    from redis.crc import key_slot
    from valkey_cluster import ValkeyCluster

    cluster = ValkeyCluster(masters=args.cluster).start()
    clients = [redis.Redis(host="127.0.0.1", port=n.port) for n in cluster.nodes]
    for c in clients:
        c.config_set("slowlog-log-slower-than", 0)
        c.config_set("slowlog-max-len", 2_000_000)
    stack = Stack(StackConfig(workers=args.workers, device="cpu", port=0, redis_url=cluster.url,
                              extra_env={"LLMSERVE_QUEUE_SHARDS": str(args.queue_shards)}))
    model = model_store.model_id(model_store.DEFAULT_MODEL)
    owners_of = {keys.queue_tag(model, k): keys.work_stream(model, 0, k) for k in range(args.queue_shards)}
    owners_of["{t:dev}"] = keys.tenant_key("dev", "rate")
    try:
        stack.start()
        run_load(stack.gateway_target, args.concurrency, args.concurrency, args.max_new_tokens, "warm")
        started = [reset(c) for c in clients]
        requests, tokens = run_load(stack.gateway_target, args.requests, args.concurrency, args.max_new_tokens, "load")
        windows = [collect(c, s, connection_owners(stack, n.port)) for c, s, n in zip(clients, started, cluster.nodes)]
    finally:
        stack.close()
        cluster.close()
    nodes = []
    for node, w in zip(cluster.nodes, windows):
        fams: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for (_, fam, _), (calls, usec) in w.rows.items():
            fams[fam][0] += calls
            fams[fam][1] += usec
        holds = [tag for tag, key in owners_of.items() if cluster.node_of(key_slot(key.encode())) is node]
        nodes.append(dict(port=node.port, holds=holds, seconds=w.seconds, cpu_us=w.cpu_us,
                          commands=sum(c for c, _ in fams.values()), usec=sum(u for _, u in fams.values()),
                          families={f: dict(commands=c, usec=u) for f, (c, u) in fams.items()}))
    return dict(requests=requests, tokens=tokens, workers=args.workers, nodes=nodes)


def print_cluster(r: dict) -> None:
    print(f"\n{r['requests']} requests, {r['tokens']} tokens, {r['workers']} workers on {len(r['nodes'])} masters")
    print(f"{'node':<8}{'holds':<22}{'commands':>9}{'cmd µs':>9}{'cpu µs':>10}   by family: commands / cmd µs")
    for n in r["nodes"]:
        fams = "  ".join(f"{f} {v['commands']:.0f}/{v['usec']:.0f}" for f, v in sorted(n["families"].items()))
        print(f"{n['port']:<8}{','.join(n['holds']) or '-':<22}{n['commands']:>9.0f}{n['usec']:>9.0f}"
              f"{n['cpu_us']:>10.0f}   {fams}")


def report(args, idle: Window, load: Window, requests: int, tokens: int) -> dict:
    idle_cpu_rate = idle.cpu_us / idle.seconds                          # µs CPU per s, background + cron
    idle_calls = sum(c for c, _ in idle.rows.values())
    idle_usec = sum(u for _, u in idle.rows.values())
    io_us = max(0.0, (load.cpu_us - idle_cpu_rate * load.seconds - (sum(u for _, u in load.rows.values())
                      - idle_usec / idle.seconds * load.seconds))
                / max(1.0, sum(c for c, _ in load.rows.values()) - idle_calls / idle.seconds * load.seconds))
    rows = net_rows(load, idle, args.workers, args.workers)
    phases: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])      # calls, usec, cpu us
    families: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])   # cpu, usec: per request, per token
    detail = []
    for (service, fam, name), (calls, usec) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        if calls < 0.5:
            continue
        ph = phase(service, fam, name)
        cpu = usec + calls * io_us
        phases[ph][0] += calls
        phases[ph][1] += usec
        phases[ph][2] += cpu
        at = 2 if ph in PER_TOKEN else 0
        families[fam][at] += cpu
        families[fam][at + 1] += usec
        detail.append(dict(service=service, family=fam, command=name, phase=ph, calls=calls, usec=usec))
    background = background_per_worker_s(idle, args.workers, io_us)
    out = dict(
        workload=dict(requests=requests, tokens=tokens, workers=args.workers, concurrency=args.concurrency,
                      max_new_tokens=args.max_new_tokens, load_s=load.seconds, idle_s=idle.seconds),
        io_us_per_call=io_us,
        per_request={p: per(phases[p], requests) for p in PER_REQUEST},
        per_token={p: per(phases[p], tokens) for p in PER_TOKEN},
        other=per(phases["other"], requests),
        family_cpu_us=dict(per_request={f: v[0] / requests for f, v in families.items()},
                           per_token={f: v[2] / tokens for f, v in families.items()}),
        family_usec=dict(per_request={f: v[1] / requests for f, v in families.items()},
                         per_token={f: v[3] / tokens for f, v in families.items()}),
        background_per_worker_s=background,
        batcher_background_s=per_second(idle, "batcher", io_us),
        idle_detail=[dict(service=k[0], family=k[1], command=k[2], calls_per_s=c / idle.seconds,
                          usec_per_s=u / idle.seconds) for k, (c, u) in sorted(idle.rows.items())],
        tokens_per_event_write=tokens / max(1.0, sum(d["calls"] for d in detail if d["command"] == "fenced_xadd")),
        tokens_per_event_read=tokens / max(1.0, sum(d["calls"] for d in detail if d["command"] == "xread")),
        detail=detail,
    )
    out["fleet"] = fleet(out, args)
    return out


def per(values: list[float], n: int) -> dict:
    calls, usec, cpu = values
    return dict(commands=calls / n, usec=usec / n, cpu_us=cpu / n)


def background_per_worker_s(idle: Window, workers: int, io_us: float) -> dict:
    """Each worker's idle traffic per second by family (heartbeats, inbox reads that time out)."""
    return {fam: {k: v / workers for k, v in row.items()} for fam, row in per_second(idle, "gpu_worker", io_us).items()}


def per_second(idle: Window, service: str, io_us: float) -> dict:
    """One service kind's idle traffic per second by family: commands, command µs, CPU µs."""
    out: dict[str, dict] = defaultdict(lambda: dict(commands=0.0, usec=0.0, cpu_us=0.0))
    for (svc, fam, _), (calls, usec) in idle.rows.items():
        if svc == service:
            out[fam]["commands"] += calls / idle.seconds
            out[fam]["usec"] += usec / idle.seconds
            out[fam]["cpu_us"] += (usec + calls * io_us) / idle.seconds
    return dict(out)


def fleet(m: dict, args) -> dict:
    """Shards for 100 and 1,000 workers at args.tokens_per_s each, every shard's main thread at
    most args.shard_busy busy: from server CPU (commands + socket I/O, as measured here) and, as
    a floor, from the commands' own time alone; and how busy one model's {m} shard is (all its
    workers' queue traffic plus one batcher's polls)."""
    budget = args.shard_busy * 1e6                                        # µs per s per shard
    req_s = args.tokens_per_s / args.tokens_per_request
    out = dict(tokens_per_s_per_worker=args.tokens_per_s, tokens_per_request=args.tokens_per_request,
               shard_busy=args.shard_busy)
    for basis, fam_costs, cost in (("cpu", m["family_cpu_us"], "cpu_us"), ("usec", m["family_usec"], "usec")):
        rate = {fam: req_s * fam_costs["per_request"].get(fam, 0.0) + args.tokens_per_s * fam_costs["per_token"].get(fam, 0.0)
                + m["background_per_worker_s"].get(fam, {}).get(cost, 0.0) for fam in ("{m}", "{r}", "{t}", "-")}
        batcher = sum(v[cost] for v in m["batcher_background_s"].values())
        per_worker = sum(rate.values())
        out[basis] = dict(us_per_worker_s=rate, per_worker_total=per_worker, batcher_us_per_s=batcher,
                          workers_per_model_shard=(budget - batcher) / max(1e-9, rate["{m}"]),
                          model_traffic_share=rate["{m}"] / per_worker,
                          fleets={n: dict(cores=(per_worker * n + batcher) / 1e6,
                                          shards=max(1, math.ceil((per_worker * n + batcher) / budget)),
                                          model_shard_busy=(rate["{m}"] * n + batcher) / 1e6,
                                          # queue cells (queue_shards) so no cell's slot is over budget:
                                          # each cell carries 1/K of the workers and one batcher loop
                                          queue_cells=max(1, math.ceil(rate["{m}"] * n / max(1e-9, budget - batcher))))
                                  for n in (100, 1000)})
    return out


def print_report(r: dict) -> None:
    w = r["workload"]
    print(f"\nworkload: {w['requests']} requests, {w['tokens']} tokens, {w['workers']} workers, "
          f"concurrency {w['concurrency']}, {w['load_s']:.1f} s; server I/O {r['io_us_per_call']:.1f} µs per call")
    print(f"\n{'per request':<14}{'commands':>10}{'cmd µs':>10}{'cpu µs':>10}")
    for name, v in r["per_request"].items():
        print(f"{name:<14}{v['commands']:>10.1f}{v['usec']:>10.1f}{v['cpu_us']:>10.1f}")
    print(f"\n{'per token':<14}{'commands':>10}{'cmd µs':>10}{'cpu µs':>10}")
    for name, v in r["per_token"].items():
        print(f"{name:<14}{v['commands']:>10.2f}{v['usec']:>10.2f}{v['cpu_us']:>10.2f}")
    print(f"tokens per event write {r['tokens_per_event_write']:.2f}, per event read {r['tokens_per_event_read']:.2f}")
    print("\nidle, per worker-second:", {f: round(v["cpu_us"], 1) for f, v in r["background_per_worker_s"].items()},
          "batcher per second:", {f: round(v["cpu_us"], 1) for f, v in r["batcher_background_s"].items()})
    print("\ntop commands (load minus idle):")
    for d in r["detail"][:16]:
        print(f"  {d['service']:<11}{d['family']:<5}{d['command']:<16}{d['phase']:<12}"
              f"{d['calls']:>8.0f} calls {d['usec']:>9.0f} µs")
    f = r["fleet"]
    print(f"\nfleet at {f['tokens_per_s_per_worker']:.0f} tokens/s per worker, {f['tokens_per_request']:.0f} tokens "
          f"per request, shards at most {f['shard_busy']:.0%} busy:")
    for basis in ("cpu", "usec"):
        b = f[basis]
        print(f"  [{basis}] {b['per_worker_total']:.0f} µs per worker-second "
              f"{({k: round(v) for k, v in b['us_per_worker_s'].items()})}, batcher {b['batcher_us_per_s']:.0f} µs/s; "
              f"{{m}} is {b['model_traffic_share']:.1%} of it")
        for workers, row in b["fleets"].items():
            print(f"    {workers:>5} workers: {row['cores']:.2f} cores -> {row['shards']} shards; "
                  f"one model's {{m}} shard {row['model_shard_busy']:.0%} busy unsharded, "
                  f"queue_shards >= {row['queue_cells']} keeps every cell under {f['shard_busy']:.0%}")
        print(f"    one model fills its {{m}} shard at {b['workers_per_model_shard']:.0f} workers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--tokens-per-s", type=float, default=2000.0, help="generated tokens/s per GPU worker")
    parser.add_argument("--tokens-per-request", type=float, default=256.0, help="mean completion length")
    parser.add_argument("--shard-busy", type=float, default=0.5, help="highest main-thread load per shard")
    parser.add_argument("--cluster", type=int, default=0, help="run on a cluster of this many masters instead")
    parser.add_argument("--queue-shards", type=int, default=1, help="queue cells per model (with --cluster)")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.cluster:
        result = measure_cluster(args)
        print_cluster(result)
        (RESULTS / "redis_cluster.json").write_text(json.dumps(result, indent=2, default=str))
        return
    result = measure(args)
    print_report(result)
    (RESULTS / "redis_capacity.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
