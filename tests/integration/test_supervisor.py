"""`llmserve up`'s supervisor on real child processes: restart with backoff, give up on a
crash loop while the other services keep running."""

from __future__ import annotations

import time

from llmserve.stack import ServiceProcess, Stack, StackConfig
from llmserve.supervisor import RestartPolicy, Supervisor

FAST = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2, crash_loop_exits=5, crash_loop_window_s=60)


def child(stack: Stack, name: str, after_s: float, code: int) -> ServiceProcess:
    proc = ServiceProcess(name, "tests.integration.exiting_service", ["--after", str(after_s), "--code", str(code)],
                          0, stack.log_dir / f"{name}.log", None)
    stack.services[name] = proc
    return proc.start()


def supervise(supervisor: Supervisor, until, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline
        supervisor.poll()
        time.sleep(0.02)


def test_exited_service_is_restarted_and_a_crash_loop_given_up(tmp_path):
    stack = Stack(StackConfig(log_dir=tmp_path))
    crashing = child(stack, "crashing", 0.0, 3)
    steady = child(stack, "steady", 600.0, 0)
    steady_pid = steady.process.pid
    said: list[str] = []
    supervisor = Supervisor(stack, FAST, say=said.append)
    supervise(supervisor, lambda: supervisor.slots["crashing"].given_up)
    restarts = [line for line in said if line.startswith("crashing exited with code 3; starting it again")]
    assert len(restarts) == FAST.crash_loop_exits - 1
    assert "crashing exited 5 times within 60 s" in said[-1] and "giving up" in said[-1]
    assert not crashing.alive()
    time.sleep(0.3)
    supervisor.poll()
    assert not crashing.alive()                      # given up: not started again
    assert steady.alive() and steady.process.pid == steady_pid
    steady.stop(5)


def test_backoff_doubles_between_restarts(tmp_path):
    stack = Stack(StackConfig(log_dir=tmp_path))
    child(stack, "crashing", 0.0, 1)
    said: list[str] = []
    supervisor = Supervisor(stack, FAST, say=said.append)
    supervise(supervisor, lambda: supervisor.slots["crashing"].given_up)
    delays = [float(line.split(" in ")[1].split()[0]) for line in said if "starting it again" in line]
    assert delays == [0.05, 0.1, 0.2, 0.2]
