"""`llmserve up` as a supervisor of its stack, the local form of compose's
`restart: unless-stopped` and of a Kubernetes rolling update:

    service exits (crash, kill -9, drained by SIGTERM) ─▶ started again after a backoff
    5 exits within 60 s                               ─▶ given up, log tail printed; the rest keep serving
    SIGHUP to `up` (roll_workers)                     ─▶ each worker in turn: drain ─▶ exit ─▶ start ─▶ SERVING

`poll()` runs on `up`'s main thread; a roll runs on a thread of its own and holds the
worker it is replacing, so `poll()` leaves that one alone.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from llmserve.stack import ServiceProcess, Stack

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    crash_loop_exits: int = 5        # this many exits ...
    crash_loop_window_s: float = 60.0  # ... within this window: given up
    roll_timeout_s: float = 600.0    # per worker: drain + restart + SERVING


@dataclass
class _Slot:
    """Restart history of one service."""

    exits: deque[float] = field(default_factory=deque)
    restart_at: float | None = None   # when the pending restart is due
    given_up: bool = False


class Supervisor:
    """Keeps every service of `stack` running until `up` is told to stop.

    Args:
        stack: a started stack.
        policy: backoff and crash-loop limits.
        say: where operator messages go (`up` prints them).
    """

    def __init__(self, stack: Stack, policy: RestartPolicy = RestartPolicy(),
                 say: Callable[[str], None] = print) -> None:
        self.stack = stack
        self.policy = policy
        self.say = say
        self.slots = {name: _Slot() for name in stack.services}
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._roll: threading.Thread | None = None
        self._stopped = False

    def stop(self) -> None:
        """Start nothing more (before the stack stops): a roll in progress ends at its next step."""
        with self._lock:
            self._stopped = True

    # -- restarts ------------------------------------------------------------------------------------
    def poll(self, now: float | None = None) -> None:
        """Notice exited services and start the ones whose backoff is over."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._stopped:
                return
            for name, proc in self.stack.services.items():
                slot = self.slots.setdefault(name, _Slot())
                if name in self._held or slot.given_up or proc.alive():
                    continue
                if slot.restart_at is None:
                    self._exited(name, proc, slot, now)
                elif now >= slot.restart_at:
                    slot.restart_at = None
                    proc.start()
                    logger.info("service restarted", service=name)

    def _exited(self, name: str, proc: ServiceProcess, slot: _Slot, now: float) -> None:
        slot.exits.append(now)
        while slot.exits and now - slot.exits[0] > self.policy.crash_loop_window_s:
            slot.exits.popleft()
        code = proc.process.returncode if proc.process else None
        if len(slot.exits) >= self.policy.crash_loop_exits:
            slot.given_up = True
            self.say(f"{name} exited {len(slot.exits)} times within {self.policy.crash_loop_window_s:.0f} s "
                     f"(last exit code {code}); giving up on it, the other services keep running. "
                     f"Last lines of {proc.log_path}:\n{proc.log_tail(20)}")
            logger.error("service crash-looping; given up", service=name, exits=len(slot.exits), code=code)
            return
        delay = min(self.policy.backoff_max_s, self.policy.backoff_initial_s * 2 ** (len(slot.exits) - 1))
        slot.restart_at = now + delay
        self.say(f"{name} exited with code {code}; starting it again in {delay:g} s")
        logger.warning("service exited; restarting", service=name, code=code, delay_s=delay)

    # -- rolling restart -----------------------------------------------------------------------------
    def roll_workers(self) -> bool:
        """Start a rolling restart of every worker in the background; False if one is running."""
        if self._roll is not None and self._roll.is_alive():
            self.say("a rolling restart is already running")
            return False
        self._roll = threading.Thread(target=self._roll_all, name="roll-workers", daemon=True)
        self._roll.start()
        return True

    def wait_roll(self, timeout_s: float) -> None:
        if self._roll is not None:
            self._roll.join(timeout_s)

    def _roll_all(self) -> None:
        workers = [p for p in self.stack.named("gpu_worker-") if not self.slots[p.name].given_up]
        self.say(f"rolling restart of {len(workers)} worker(s)")
        for proc in workers:
            try:
                self._roll_one(proc)
            except (RuntimeError, TimeoutError) as exc:
                self.say(f"rolling restart stopped at {proc.name}: {exc}")
                return
        self.say("rolling restart done")

    def _roll_one(self, proc: ServiceProcess) -> None:
        deadline = time.monotonic() + self.policy.roll_timeout_s
        with self._lock:
            self._held.add(proc.name)
        try:
            self.say(f"draining {proc.name}")
            proc.signal(signal.SIGTERM)
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if code is None:
                proc.popen.kill()
                proc.popen.wait()
            with self._lock:
                if self._stopped:
                    return
                proc.start()
            proc.wait_serving(deadline)
            self.say(f"{proc.name} replaced (old one exited {code}) and SERVING")
        finally:
            with self._lock:
                self._held.discard(proc.name)
