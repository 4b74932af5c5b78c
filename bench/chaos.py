"""Chaos under steady load: `llmserve up` as a process, and every 20-40 s a random child of it
(Valkey, the tokenizer, the batcher, a gateway, a worker) killed with SIGKILL.

    .venv/bin/python bench/chaos.py [--duration-s 600] [--interval-s 20 40] [--workers 2]
        [--streams 4] [--max-new-tokens 32] [--timeout-s 60] [--retry-attempts 10] [--seed 0]

The load is waves of `--streams` concurrent seeded streams (temperature 0.8) through the client
SDK (`llmserve.loadgen.streams.StreamLoad`), one wave after another for the whole run; every
wave asks the same prompts with the same seeds, so every wave must give the first wave's tokens.
The first wave runs before the first fault. After each kill it measures the recovery: the time
until the victim runs again (a new pid), the fleet's workers are all live and a probe request
completes. At the end it prints, and writes as JSON with `--out`:

  lost         requests that ended in an error (goal 0)
  hung         requests that ran past their deadline by more than 5 s (goal 0)
  bad indices  requests whose chunks skipped or repeated a token index (goal 0)
  diverged     requests whose tokens differ from the fault-free first wave (goal 0)
  per fault    victim, seconds after start, recovery seconds

Exit status 0 when every goal is met and every fault recovered. Needs the model in the cache
(`llmserve fetch-model`). The opt-in test tests/fault/test_chaos.py (LLMSERVE_CHAOS=1) runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmserve.client import Client, LLMServeError, RetryPolicy  # noqa: E402
from llmserve.clock import now_ms  # noqa: E402
from llmserve.loadgen.streams import PROMPTS, StreamLoad, StreamRecord  # noqa: E402
from tests.fault.up_process import UpProcess  # noqa: E402

HANG_SLACK_S = 5.0
RECOVERY_LIMIT_S = 180.0


@dataclass
class Fault:
    victim: str
    at_s: float                       # seconds after the load started
    recovery_s: float | None = None   # None: not whole again within RECOVERY_LIMIT_S


class Waves:
    """Waves of the same seeded streams, one after another on a thread, until stopped."""

    def __init__(self, load: StreamLoad) -> None:
        self.load = load
        self.records: list[list[StreamRecord]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def first(self) -> list[StreamRecord]:
        """Run the fault-free first wave, then keep the waves coming in the background."""
        self.records.append(self.load.run("wave0"))
        self._thread.start()
        return self.records[0]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.records.append(self.load.run(f"wave{len(self.records)}"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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


def inflict(up: UpProcess, rng: random.Random, started: float, workers: int) -> Fault:
    pids = children(up)
    victim = rng.choice(sorted(pids))
    fault = Fault(victim, time.monotonic() - started)
    os.kill(pids[victim], signal.SIGKILL)
    fault.recovery_s = recovery_s(up, victim, pids[victim], workers)
    print(f"  {fault.at_s:6.1f} s  kill -9 {victim:<14} recovered in "
          f"{'never' if fault.recovery_s is None else f'{fault.recovery_s:.1f} s'}", flush=True)
    return fault


def judge(records: list[StreamRecord], first: list[StreamRecord], timeout_s: float) -> dict[str, list[str]]:
    """Every request that missed a goal, by goal."""
    out: dict[str, list[str]] = {"lost": [], "hung": [], "bad indices": [], "diverged": []}
    for got, want in zip(records, first * (len(records) // len(first))):
        if got.error or got.finish_reason not in ("stop", "length"):
            out["lost"].append(f"{got.request_id}: {got.error or got.finish_reason}")
        if got.end_s - got.start_s > timeout_s + HANG_SLACK_S:
            out["hung"].append(f"{got.request_id}: {got.end_s - got.start_s:.1f} s")
        if not got.contiguous():
            out["bad indices"].append(f"{got.request_id}: {got.chunk_indices}")
        if not got.error and got.token_ids != want.token_ids:
            out["diverged"].append(got.request_id)
    return out


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="llmserve-chaos-") as run_dir:
        up = UpProcess.start(Path(run_dir), workers=args.workers)
        faults: list[Fault] = []
        try:
            up.wait_workers(args.workers, timeout_s=RECOVERY_LIMIT_S)
            load = StreamLoad(up.gateway_target, "dev-key", PROMPTS[:args.streams], max_new_tokens=args.max_new_tokens,
                              timeout_s=args.timeout_s, retry=RetryPolicy(max_attempts=args.retry_attempts),
                              temperature=0.8)
            waves = Waves(load)
            first = waves.first()
            started = time.monotonic()
            print(f"chaos for {args.duration_s:.0f} s, a kill every {args.interval_s[0]:g}-{args.interval_s[1]:g} s",
                  flush=True)
            while time.monotonic() - started < args.duration_s:
                time.sleep(rng.uniform(*args.interval_s))
                faults.append(inflict(up, rng, started, args.workers))
            waves.stop()
        finally:
            code = up.stop()
    records = [r for wave in waves.records[1:] for r in wave]
    return {"requests": len(records), "faults": [asdict(f) for f in faults], "up_exit_code": code,
            "misses": judge(records, first, args.timeout_s)}


def report(result: dict) -> bool:
    misses = result["misses"]
    print(f"\n{result['requests']} requests under {len(result['faults'])} faults")
    for goal, missed in misses.items():
        print(f"  {goal:<12} {len(missed)}  (goal 0)" + "".join(f"\n      {m}" for m in missed[:10]))
    for fault in result["faults"]:
        rec = fault["recovery_s"]
        print(f"  {fault['victim']:<14} at {fault['at_s']:6.1f} s: recovered in {'never' if rec is None else f'{rec:.1f} s'}")
    recovered = all(f["recovery_s"] is not None for f in result["faults"])
    return recovered and result["up_exit_code"] == 0 and not any(misses.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--interval-s", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN", "MAX"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="each request's deadline")
    parser.add_argument("--retry-attempts", type=int, default=RetryPolicy().max_attempts,
                        help="the SDK's attempts per request (default: the SDK's own)")
    parser.add_argument("--seed", type=int, default=0, help="picks the victims and the intervals")
    parser.add_argument("--out", default="", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if report(result) else 1


if __name__ == "__main__":
    sys.exit(main())
