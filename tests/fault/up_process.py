"""`llmserve up` run as an operator runs it: a process of its own, signalled from outside.

    up = UpProcess.start(run_dir, workers=2)         # `up` runs in run_dir: its state in run_dir/.llmserve
    up.gateway_target, up.redis_url                 # parsed from what `up` printed
    os.kill(up.worker_pids()["gpu_worker-0"], signal.SIGKILL)
    up.wait_workers(2, timeout_s=90)                # until 2 workers heartbeat and take work
    up.stop()                                       # SIGINT, as Ctrl-C
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from llmserve.catalog import model_store
from llmserve.protocol import keys
from llmserve.runtime.clock import now_ms
from llmserve.v1 import queue_pb2

_UP_LINE = re.compile(r"llmserve is up: gateway at (\S+)\s+\(Redis (\S+)\)")
HEARTBEAT_FRESH_MS = 2000


@dataclass
class UpProcess:
    process: subprocess.Popen
    run_dir: Path
    gateway_target: str
    redis_url: str

    @classmethod
    def start(cls, run_dir: Path, workers: int, tenants: Path | None = None, timeout_s: float = 300.0,
              extra_env: dict[str, str] | None = None, llmserve: Path | None = None,
              flags: tuple[str, ...] = ()) -> UpProcess:
        """`llmserve up` (default: the one next to this Python; tenants: its default) started in `run_dir`."""
        run_dir.mkdir(parents=True, exist_ok=True)
        out, err = open(run_dir / "up.stdout", "wb"), open(run_dir / "up.stderr", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        env.pop("REDIS_URL", None)
        argv = [str(llmserve or Path(sys.executable).parent / "llmserve"), "up", "--port", "0", "--http-port", "0",
                "--workers", str(workers), "--device", "cpu", *flags]
        if tenants is not None:
            argv += ["--tenants", str(tenants)]
        process = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=run_dir)
        out.close()
        err.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            match = _UP_LINE.search((run_dir / "up.stdout").read_text(errors="replace"))
            if match:
                return cls(process, run_dir, match.group(1), match.group(2))
            time.sleep(0.2)
        process.kill()
        process.wait()
        raise RuntimeError(f"llmserve up did not come up: {(run_dir / 'up.stderr').read_text()[-3000:]}")

    # -- what an operator sees -------------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self.run_dir / ".llmserve"

    def stdout_text(self) -> str:
        return (self.run_dir / "up.stdout").read_text(errors="replace")

    def stderr_text(self) -> str:
        return (self.run_dir / "up.stderr").read_text(errors="replace")

    def service_log(self, name: str) -> str:
        return (self.state_dir / "logs" / f"{name}.log").read_text(errors="replace")

    def children(self) -> dict[int, list[bytes]]:
        """pid -> argv of every child of `up` now (zombies included: their argv is empty)."""
        out = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.process.pid:
                out[int(proc.name)] = argv
        return out

    def service_pids(self) -> dict[str, int]:
        """Service name (the stem of its --port-file: gpu_worker-0, gateway-0, ...) -> pid, now."""
        return {Path(argv[argv.index(b"--port-file") + 1].decode()).stem: pid
                for pid, argv in self.children().items() if b"--port-file" in argv}

    def worker_pids(self) -> dict[str, int]:
        """Worker name -> pid of the `python -m gpu_worker` children of `up` now."""
        return {name: pid for name, pid in self.service_pids().items() if name.startswith("gpu_worker-")}

    def valkey_pid(self) -> int:
        """The pid of the valkey-server `up` started (and supervises)."""
        pids = [pid for pid, argv in self.children().items() if argv and b"valkey-server" in argv[0]]
        assert len(pids) == 1, self.children()
        return pids[0]

    def heartbeats(self) -> list[queue_pb2.WorkerHeartbeat]:
        """The workers' heartbeats in Redis now (none while Redis is down)."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            raw = client.hgetall(keys.workers_hash(model_store.model_id(model_store.DEFAULT_MODEL)))
        except redis.ConnectionError:
            return []
        finally:
            client.close()
        return [queue_pb2.WorkerHeartbeat.FromString(v) for v in raw.values()]

    def live_workers(self) -> list[str]:
        """Workers whose heartbeat is fresh and who take work (what the batcher dispatches to)."""
        now = now_ms()
        return sorted(b.worker_id for b in self.heartbeats()
                      if not b.draining and now - b.sent_unix_ms < HEARTBEAT_FRESH_MS)

    def joined_workers(self) -> list[str]:
        """Workers that have joined and are not draining (a heartbeat, fresh or not: no clock involved)."""
        return sorted(b.worker_id for b in self.heartbeats() if not b.draining)

    def wait_workers(self, count: int, timeout_s: float) -> None:
        """Block until `count` workers are live."""
        deadline = time.monotonic() + timeout_s
        while len(self.live_workers()) < count:
            assert time.monotonic() < deadline, f"workers not whole after {timeout_s} s: {self.live_workers()}"
            assert self.process.poll() is None, f"llmserve up exited: {self.stderr_text()[-2000:]}"
            time.sleep(0.2)

    def watch_fleet(self, count: int) -> FleetWatch:
        return FleetWatch(self, count)

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def stop(self, timeout_s: float = 120.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


class FleetWatch:
    """Samples the live worker count from now on, in the background: when it fell short of
    `count` and when it was whole again (the recovery time an operator sees), and the fewest
    workers joined and not draining at any sample (`fewest_joined`: how many were down at once)."""

    def __init__(self, up: UpProcess, count: int, interval_s: float = 0.2) -> None:
        self.up, self.count, self.interval_s = up, count, interval_s
        self.started = time.monotonic()
        self.short_at: float | None = None
        self.whole_at: float | None = None
        self.fewest_joined = count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            live = len(self.up.live_workers())
            self.fewest_joined = min(self.fewest_joined, len(self.up.joined_workers()))
            if live < self.count and self.short_at is None:
                self.short_at = time.monotonic()
            elif live >= self.count and self.short_at is not None and self.whole_at is None:
                self.whole_at = time.monotonic()

    def recovery_s(self, timeout_s: float) -> float:
        """Seconds from the start until whole again (0 when it never fell short); waits up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.short_at is not None and self.whole_at is None:
            assert time.monotonic() < deadline, f"workers not whole after {timeout_s} s: {self.up.live_workers()}"
            time.sleep(self.interval_s)
        self._stop.set()
        return 0.0 if self.whole_at is None else self.whole_at - self.started
