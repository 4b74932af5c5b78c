"""Chaos under steady load: `llmserve up` as a process, and kill -9 of each of its children in
turn (a worker, the batcher, the tokenizer, the gateway, Valkey; a fresh shuffled round after
each round) at random intervals of 20-40 s, while seeded streams run.

    .venv/bin/python bench/chaos.py [--duration-s 600] [--interval-s 20 40] [--workers 2]
        [--streams 4] [--max-new-tokens 32] [--timeout-s 120] [--seed 0] [--out FILE.json]

The clients are what a production caller runs: the client SDK (`llmserve.loadgen.streams`),
retrying UNAVAILABLE with jittered exponential backoff until each request's deadline, and after
a dropped stream (a gateway killed under it) re-attaching by its request_id with
`x-resume-from: <next index>`. The load is waves of `--streams` concurrent seeded streams
(temperature 0.8), one wave after another for the whole run; every wave asks the same prompts
with the same seeds, so every wave must give the tokens of the first, fault-free wave. After
each wave the durable token-event stream of each request is read back from Valkey.

After each kill it measures the recovery: until the victim runs again (a new pid), every worker
has beaten since the kill and a probe request completes. It prints, and writes as JSON with
`--out` (bench/results/chaos/ keeps the committed runs):

  lost          requests that ended in an error or without a finish reason (goal 0)
  duplicated    requests whose caller got a token index twice, or whose durable stream holds
                one position with two different tokens (two runs spliced) (goal 0)
  gaps          requests whose caller missed a token index (goal 0)
  mismatches    requests whose tokens differ from the fault-free first wave (goal 0)
  hung          requests that ran past their deadline by more than 5 s (goal 0)
  executed_more_than_once  requests whose durable stream has more than one final event: a
                redelivery (at-least-once) that the index dedupe hid from the caller (informational)
  longest_stall_s  the longest any stream waited for its next chunk
  kills, faults the kills per service; per kill: victim, seconds after start, recovery seconds,
                and its stall: the longest wait for a chunk that ended between this kill and the
                next (a stream's wait for its first chunk included)

Exit status 0 when every goal is met and every fault recovered. Needs the model in the cache
(`llmserve fetch-model`). The opt-in test tests/fault/test_chaos.py (LLMSERVE_CHAOS=1) runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmserve.client import Client, LLMServeError, RetryPolicy  # noqa: E402
from llmserve.loadgen.streams import PROMPTS, StreamLoad, StreamRecord  # noqa: E402
from llmserve.protocol import keys, queue  # noqa: E402
from llmserve.runtime.clock import now_ms  # noqa: E402
from tests.fault.up_process import UpProcess  # noqa: E402

SERVICES = ("gpu_worker", "batcher", "tokenizer_svc", "gateway", "valkey")
TENANT = "dev"              # the tenant of "dev-key" in the default tenants file
HANG_SLACK_S = 5.0
RECOVERY_LIMIT_S = 180.0
AUDIT_WAIT_S = 120.0        # how long a durable-stream read waits out a Valkey restart


@dataclass
class Fault:
    victim: str
    at_s: float                       # seconds after the load started
    recovery_s: float | None = None   # None: not whole again within RECOVERY_LIMIT_S
    stall_s: float | None = None      # the longest wait for a chunk that ended before the next kill


@dataclass
class Audit:
    """What one request's durable token-event stream holds."""

    finals: int = 0
    spliced: bool = False             # a position written with two different tokens
    read: bool = True                 # False: Valkey stayed unreachable


@dataclass
class Wave:
    records: list[StreamRecord]
    audits: dict[str, Audit] = field(default_factory=dict)


def audit_stream(client: redis.Redis, request_id: str) -> Audit:
    audit, tokens = Audit(), {}
    for _, fields in client.xrange(keys.events_stream(TENANT, request_id)):
        event = queue.decode_event(fields)
        audit.finals += event.final
        for at, token in enumerate(event.token_ids, start=event.index):
            audit.spliced |= tokens.setdefault(at, token) != token
    return audit


def audit_wave(redis_url: str, records: list[StreamRecord]) -> dict[str, Audit]:
    """Each request's durable stream, read back (waiting out a Valkey that is being restarted)."""
    deadline = time.monotonic() + AUDIT_WAIT_S
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0)
    try:
        while True:
            try:
                return {r.request_id: audit_stream(client, r.request_id) for r in records}
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError):
                if time.monotonic() > deadline:
                    return {r.request_id: Audit(read=False) for r in records}
                time.sleep(1.0)
    finally:
        client.close()


class Waves:
    """Waves of the same seeded streams, one after another on a thread, until stopped."""

    def __init__(self, load: StreamLoad, redis_url: str) -> None:
        self.load, self.redis_url = load, redis_url
        self.waves: list[Wave] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> Wave:
        records = self.load.run(f"wave{len(self.waves)}")
        return Wave(records, audit_wave(self.redis_url, records))

    def first(self) -> Wave:
        """Run the fault-free first wave, then keep the waves coming in the background."""
        self.waves.append(self._one())
        self._thread.start()
        return self.waves[0]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.waves.append(self._one())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def records(self) -> list[StreamRecord]:
        return [r for wave in self.waves for r in wave.records]


class Victims:
    """Each service in turn, in a fresh seeded shuffle every round; a worker picked at random."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.round: list[str] = []

    def next(self, running: dict[str, int]) -> str:
        """The next victim among the children running now (a service with none running is skipped)."""
        while True:
            if not self.round:
                self.round = self.rng.sample(SERVICES, len(SERVICES))
            service = self.round.pop()
            candidates = sorted(name for name in running if service_of(name) == service)
            if candidates:
                return self.rng.choice(candidates)


def service_of(child: str) -> str:
    """gpu_worker-1 -> gpu_worker, gateway-0 -> gateway."""
    return child.rsplit("-", 1)[0] if child[-1].isdigit() else child


def children(up: UpProcess) -> dict[str, int]:
    """Every child of `up` running now, by name, Valkey included."""
    pids = up.service_pids()
    for pid, argv in up.children().items():
        if argv and b"valkey-server" in argv[0]:      # a zombie's argv is empty
            pids["valkey"] = pid
    return pids


def workers_beating_since(up: UpProcess, since_ms: int) -> int:
    """Workers taking work whose heartbeat was sent after `since_ms` (a restarted one counts once it beats)."""
    return sum(1 for b in up.heartbeats() if not b.draining and b.sent_unix_ms > since_ms)


def probe_ok(target: str) -> bool:
    with Client(target, api_key="dev-key", retry=RetryPolicy(max_attempts=1)) as client:
        try:
            client.complete(prompt="ping", max_new_tokens=1, temperature=0.0, timeout=10.0)
            return True
        except LLMServeError:
            return False


def recovery_s(up: UpProcess, victim: str, old_pid: int, workers: int) -> float | None:
    """Seconds until `victim` runs with a new pid, every worker has beaten since the kill and a
    probe request completes."""
    start, killed_ms = time.monotonic(), now_ms()
    while time.monotonic() - start < RECOVERY_LIMIT_S:
        pid = children(up).get(victim)
        if (pid not in (None, old_pid) and workers_beating_since(up, killed_ms) >= workers
                and probe_ok(up.gateway_target)):
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def inflict(up: UpProcess, victims: Victims, started: float, workers: int) -> Fault:
    pids = children(up)
    victim = victims.next(pids)
    fault = Fault(victim, time.monotonic() - started)
    os.kill(pids[victim], signal.SIGKILL)
    fault.recovery_s = recovery_s(up, victim, pids[victim], workers)
    print(f"  {fault.at_s:6.1f} s  kill -9 {victim:<14} recovered in "
          f"{'never' if fault.recovery_s is None else f'{fault.recovery_s:.1f} s'}", flush=True)
    return fault


def repeats_an_index(record: StreamRecord) -> bool:
    """The caller got a chunk that starts before the end of what it already had."""
    ends = [i + n for i, n in zip(record.chunk_indices, record.chunk_tokens)]
    return any(index < end for index, end in zip(record.chunk_indices[1:], ends))


def judge(waves: list[Wave], first: Wave, timeout_s: float) -> dict[str, list[str]]:
    """Every request that missed a goal (or was executed more than once), by goal."""
    out: dict[str, list[str]] = {"lost": [], "duplicated": [], "gaps": [], "mismatches": [], "hung": [],
                                 "executed_more_than_once": [], "unaudited": []}
    for wave in waves:
        for got, want in zip(wave.records, first.records):
            audit = wave.audits[got.request_id]
            if got.error or got.finish_reason not in ("stop", "length"):
                out["lost"].append(f"{got.request_id}: {got.error or got.finish_reason}")
            if repeats_an_index(got) or audit.spliced:
                out["duplicated"].append(f"{got.request_id}: {got.chunk_indices} spliced={audit.spliced}")
            elif not got.contiguous():
                out["gaps"].append(f"{got.request_id}: {got.chunk_indices}")
            if not got.error and got.token_ids != want.token_ids:
                out["mismatches"].append(got.request_id)
            if got.end_s - got.start_s > timeout_s + HANG_SLACK_S:
                out["hung"].append(f"{got.request_id}: {got.end_s - got.start_s:.1f} s")
            if audit.finals > 1:
                out["executed_more_than_once"].append(f"{got.request_id}: {audit.finals} final events")
            if not audit.read:
                out["unaudited"].append(got.request_id)
    return out


def waits(records: list[StreamRecord]) -> list[tuple[float, float]]:
    """Every wait of a stream for its next chunk (its first one included), as (ended at, seconds)."""
    return [(b, b - a) for r in records for a, b in zip([r.start_s, *r.chunk_times_s], r.chunk_times_s)]


def stalls_after(faults: list[Fault], started: float, records: list[StreamRecord]) -> None:
    """Each fault's stall: the longest wait that ended between it and the next fault (or the end)."""
    all_waits = waits(records)
    for fault, later in zip(faults, [*faults[1:], None]):
        start, end = started + fault.at_s, started + later.at_s if later else float("inf")
        fault.stall_s = max((s for at, s in all_waits if start <= at < end), default=None)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu_model": model, "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    host = machine()
    faults: list[Fault] = []
    with tempfile.TemporaryDirectory(prefix="llmserve-chaos-") as run_dir:
        up = UpProcess.start(Path(run_dir), workers=args.workers)
        try:
            up.wait_workers(args.workers, timeout_s=RECOVERY_LIMIT_S)
            # A production caller retries a retryable failure until its deadline, not a fixed count.
            retry = RetryPolicy(max_attempts=10_000, initial_s=0.1, max_backoff_s=2.0, rng=random.Random(args.seed))
            load = StreamLoad(up.gateway_target, "dev-key", PROMPTS[:args.streams], max_new_tokens=args.max_new_tokens,
                              timeout_s=args.timeout_s, retry=retry, temperature=0.8)
            waves = Waves(load, up.redis_url)
            first = waves.first()
            started, victims = time.monotonic(), Victims(rng)
            print(f"chaos for {args.duration_s:.0f} s, a kill every {args.interval_s[0]:g}-{args.interval_s[1]:g} s",
                  flush=True)
            while time.monotonic() - started < args.duration_s:
                time.sleep(rng.uniform(*args.interval_s))
                faults.append(inflict(up, victims, started, args.workers))
            waves.stop()
        finally:
            code = up.stop()
    later = waves.waves[1:]
    records = [r for wave in later for r in wave.records]
    stalls_after(faults, started, records)
    misses = judge(later, first, args.timeout_s)
    return {**host, "duration_s": args.duration_s, "workers": args.workers, "streams": args.streams,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed, "requests": len(records),
            **{goal: len(missed) for goal, missed in misses.items()},
            "longest_stall_s": round(max((s for _, s in waits(records)), default=0.0), 2),
            "kills": dict(Counter(service_of(f.victim) for f in faults)),
            "faults": [asdict(f) for f in faults], "up_exit_code": code, "misses": misses}


GOALS = ("lost", "duplicated", "gaps", "mismatches", "hung", "unaudited")


def report(result: dict) -> bool:
    misses = result["misses"]
    print(f"\n{result['requests']} requests under {len(result['faults'])} kills {result['kills']} "
          f"({result['cpu_model']}, {result['cpus']} CPUs); longest stall {result['longest_stall_s']:.1f} s")
    for goal, missed in misses.items():
        aim = "  (goal 0)" if goal in GOALS else ""
        print(f"  {goal:<24} {len(missed)}{aim}" + "".join(f"\n      {m}" for m in missed[:10]))
    for fault in result["faults"]:
        rec, stall = fault["recovery_s"], fault["stall_s"]
        print(f"  {fault['victim']:<14} at {fault['at_s']:6.1f} s: recovered in "
              f"{'never' if rec is None else f'{rec:.1f} s'}, stall until the next kill "
              f"{'-' if stall is None else f'{stall:.1f} s'}")
    recovered = all(f["recovery_s"] is not None for f in result["faults"])
    return recovered and result["up_exit_code"] == 0 and not any(misses[goal] for goal in GOALS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=float(os.environ.get("LLMSERVE_CHAOS_DURATION_S", 600)),
                        help="how long the kills go on (default: env LLMSERVE_CHAOS_DURATION_S, else 600)")
    parser.add_argument("--interval-s", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN", "MAX"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams per wave")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="each request's deadline")
    parser.add_argument("--seed", type=int, default=0, help="picks the victims, the intervals and the backoffs")
    parser.add_argument("--out", default="", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if report(result) else 1


if __name__ == "__main__":
    sys.exit(main())
