"""`llmserve up`'s supervisor on real child processes: restart with capped backoff, a crash loop
retried at a slower pace (never given up) while the other services keep running, and the Valkey
`up` started restarted after kill -9 on its port with its data."""

from __future__ import annotations

import os
import signal
import time

import redis

from llmserve.local.stack import ServiceProcess, Stack, StackConfig
from llmserve.local.supervisor import RestartPolicy, Supervisor
from llmserve.local.valkey import ValkeyServer

FAST = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2, crash_loop_exits=5, crash_loop_window_s=60,
                     crash_loop_retry_s=0.5)


def child(stack: Stack, name: str, after_s: float, code: int, *flags: str) -> ServiceProcess:
    proc = ServiceProcess(name, "tests.integration.exiting_service",
                          ["--after", str(after_s), "--code", str(code), *flags],
                          0, stack.log_dir / f"{name}.log", None)
    stack.services[name] = proc
    return proc.start()


def supervise(supervisor: Supervisor, until, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline
        supervisor.poll()
        time.sleep(0.02)


def test_a_crash_loop_is_retried_slowly_and_ends_when_its_cause_does(tmp_path):
    stack = Stack(StackConfig(log_dir=tmp_path))
    cause = tmp_path / "redis-is-down"
    cause.touch()
    crashing = child(stack, "crashing", 0.0, 3, "--while-exists", str(cause))
    steady = child(stack, "steady", 600.0, 0)
    steady_pid = steady.popen.pid
    said: list[str] = []
    supervisor = Supervisor(stack, FAST, say=said.append)
    supervise(supervisor, lambda: supervisor.slots["crashing"].crash_looping)
    loop = next(line for line in said if "crash-looping" in line)
    fast = [line for line in said[:said.index(loop)] if line.startswith("crashing exited with code 3; starting it again")]
    assert len(fast) == FAST.crash_loop_exits - 1
    assert "crashing exited 5 times within 60 s" in loop and str(crashing.log_path) in loop
    assert said[-1] == "crashing exited with code 3; starting it again in 0.5 s"
    supervise(supervisor, lambda: supervisor.slots["crashing"].restarts == FAST.crash_loop_exits + 1)
    assert sum("crash-looping" in line for line in said) == 1          # the log tail once, not per retry
    cause.unlink()                                                     # the dependency is back
    supervise(supervisor, lambda: "staying up" in crashing.log_path.read_text() and crashing.alive())
    supervisor.poll()
    assert crashing.alive() and supervisor.slots["crashing"].restart_at is None
    assert steady.alive() and steady.popen.pid == steady_pid
    crashing.stop(5)
    steady.stop(5)


def test_backoff_doubles_up_to_its_cap_then_slows_to_the_crash_loop_pace(tmp_path):
    stack = Stack(StackConfig(log_dir=tmp_path))
    child(stack, "crashing", 0.0, 1)
    said: list[str] = []
    supervisor = Supervisor(stack, FAST, say=said.append)
    supervise(supervisor, lambda: supervisor.slots["crashing"].restarts == FAST.crash_loop_exits + 1)
    delays = [float(line.split(" in ")[1].split()[0]) for line in said if "starting it again" in line]
    assert delays[:6] == [0.05, 0.1, 0.2, 0.2, 0.5, 0.5]
    stack.services["crashing"].stop(5)


def test_killed_valkey_is_restarted_on_its_port_with_its_data_and_reaped(tmp_path):
    stack = Stack(StackConfig(log_dir=tmp_path))
    stack.valkey = ValkeyServer(data_dir=tmp_path / "valkey", appendfsync="everysec").start()
    port, old_pid = stack.valkey.port, stack.valkey.process.pid
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.xadd("accepted", {"n": "1"})          # acknowledged before the kill: must survive it
        said: list[str] = []
        supervisor = Supervisor(stack, FAST, say=said.append)
        os.kill(old_pid, signal.SIGKILL)
        supervise(supervisor, lambda: supervisor.slots["valkey"].restarts == 1 and stack.valkey.alive())
        assert said[0] == "valkey exited with code -9; starting it again in 0.05 s"
        assert stack.valkey.port == port and stack.valkey.process.pid != old_pid
        assert not os.path.exists(f"/proc/{old_pid}")  # reaped, no zombie left
        assert client.xlen("accepted") == 1
    finally:
        client.close()
        stack.valkey.close()
