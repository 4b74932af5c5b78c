"""`llmserve up` as a supervisor of its stack, the local form of compose's
`restart: unless-stopped` and of a Kubernetes rolling update:

    child exits (crash, kill -9, drained by SIGTERM)  ─▶ started again after a backoff (doubling, capped)
    5 exits within 60 s (a crash loop)                ─▶ its log tail printed once; retried every 30 s
                                                         until it runs 60 s without exiting
    exit code 2 (a refused configuration)             ─▶ its own one line said on up's terminal; not restarted
    SIGHUP to `up` (roll_workers)                     ─▶ each worker in turn: drain ─▶ exit ─▶ start ─▶ SERVING

The children are the services and the Valkey `up` started (same port, same AOF). Nothing is
given up for good: a service that crash-loops because a dependency is down (Redis, the tokenizer)
comes back once the dependency does. The one exception is exit code 2, a service's "my
configuration is wrong" (gpu_worker's refusal of an unsupported model, a bad flag): starting it
again cannot help, so `up` says the line the child wrote last and what the operator must change,
and leaves that child stopped while the others run. Every exit and restart is logged with
structured fields (service, exit code, restarts so far, delay, crash_looping).

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
from pathlib import Path
from typing import Protocol

import structlog

from llmserve.local.stack import ServiceProcess, Stack

logger = structlog.get_logger(__name__)

# A service refusing its configuration (an unsupported model, a bad flag; argparse's code too):
# no restart can help.
REFUSED_EXIT_CODE = 2


class Child(Protocol):
    """What the supervisor needs of a child process (ServiceProcess, ValkeyServer)."""

    name: str
    log_path: Path

    def alive(self) -> bool: ...
    @property
    def exit_code(self) -> int | None: ...
    def start(self) -> object: ...
    def log_tail(self, lines: int = 30) -> str: ...


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    crash_loop_exits: int = 5          # this many exits ...
    crash_loop_window_s: float = 60.0  # ... within this window: a crash loop, until it runs this long
    crash_loop_retry_s: float = 30.0   # the delay between restarts while crash-looping
    roll_timeout_s: float = 600.0      # per worker: drain + restart + SERVING


@dataclass
class _Slot:
    """Restart history of one child."""

    exits: deque[float] = field(default_factory=deque)
    restart_at: float | None = None   # when the pending restart is due
    started_at: float | None = None   # when it was last started by the supervisor
    restarts: int = 0
    crash_looping: bool = False
    refused: bool = False             # exited REFUSED_EXIT_CODE: left stopped


def refusal(child: Child) -> str | None:
    """What `up` tells the operator about a child that exited REFUSED_EXIT_CODE (None for any other
    exit): the one line the child wrote last, and what to change."""
    if child.exit_code != REFUSED_EXIT_CODE:
        return None
    lines = [line for line in child.log_tail(10).splitlines() if line.strip()]
    line = lines[-1] if lines else f"(nothing in {child.log_path})"
    return (f"{child.name} refused its configuration (exit code {REFUSED_EXIT_CODE}): {line}\n"
            f"  not restarting it: change what that line names (--model, the models file, a flag) and start "
            f"`llmserve up` again")


class Supervisor:
    """Keeps every child of `stack` running until `up` is told to stop.

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
        self.slots = {child.name: _Slot() for child in self.children()}
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._roll: threading.Thread | None = None
        self._stopped = False

    def stop(self) -> None:
        """Start nothing more (before the stack stops): a roll in progress ends at its next step."""
        with self._lock:
            self._stopped = True

    def children(self) -> list[Child]:
        """Valkey first (every service needs it), then the services."""
        valkey: list[Child] = [self.stack.valkey] if self.stack.valkey else []
        return [*valkey, *self.stack.services.values()]

    # -- restarts ------------------------------------------------------------------------------------
    def poll(self, now: float | None = None) -> None:
        """Notice exited children and start the ones whose backoff is over."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._stopped:
                return
            for child in self.children():
                slot = self.slots.setdefault(child.name, _Slot())
                if child.name in self._held or slot.refused or child.alive():
                    continue
                if slot.restart_at is None:
                    self._exited(child, slot, now)
                elif now >= slot.restart_at:
                    self._restart(child, slot, now)

    def _restart(self, child: Child, slot: _Slot, now: float) -> None:
        slot.restart_at = None
        slot.started_at = now
        slot.restarts += 1
        try:
            child.start()
        except (RuntimeError, OSError) as exc:   # Valkey's start waits for it; the next poll counts the exit
            logger.error("restart failed", service=child.name, error=str(exc), restarts=slot.restarts)
            return
        logger.info("service restarted", service=child.name, restarts=slot.restarts, crash_looping=slot.crash_looping)

    def _exited(self, child: Child, slot: _Slot, now: float) -> None:
        said = refusal(child)
        if said is not None:
            slot.refused = True
            self.say(f"{said}; the other services keep running")
            logger.error("service refused its configuration; not restarting it", service=child.name,
                         code=child.exit_code, restarts=slot.restarts)
            return
        if slot.started_at is not None and now - slot.started_at >= self.policy.crash_loop_window_s:
            slot.exits.clear()            # it ran a whole window: whatever looped is over
            slot.crash_looping = False
        slot.exits.append(now)
        while slot.exits and now - slot.exits[0] > self.policy.crash_loop_window_s:
            slot.exits.popleft()
        code = child.exit_code
        if not slot.crash_looping and len(slot.exits) >= self.policy.crash_loop_exits:
            slot.crash_looping = True
            self.say(f"{child.name} exited {len(slot.exits)} times within {self.policy.crash_loop_window_s:.0f} s "
                     f"(last exit code {code}); crash-looping: starting it every "
                     f"{self.policy.crash_loop_retry_s:g} s until it stays up, the other services keep running. "
                     f"Last lines of {child.log_path}:\n{child.log_tail(20)}")
        delay = self._delay(slot)
        slot.restart_at = now + delay
        self.say(f"{child.name} exited with code {code}; starting it again in {delay:g} s")
        logger.warning("service exited; restarting", service=child.name, code=code, delay_s=delay,
                       restarts=slot.restarts, exits_in_window=len(slot.exits), crash_looping=slot.crash_looping)

    def _delay(self, slot: _Slot) -> float:
        if slot.crash_looping:
            return self.policy.crash_loop_retry_s
        return min(self.policy.backoff_max_s, self.policy.backoff_initial_s * 2 ** (len(slot.exits) - 1))

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
        workers = [p for p in self.stack.named("gpu_worker-") if p.alive()]
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
