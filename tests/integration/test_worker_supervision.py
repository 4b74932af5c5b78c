"""The worker process under faults of its own and of Redis, on a tiny random Llama and a real
Valkey (the test plays gateway and batcher, as in test_worker_service.py):

* a step that never returns: the worker goes NOT_SERVING, deletes its heartbeat, exits 1;
* Redis out of memory (`maxmemory` far below use, `noeviction`) for 5 s: it carries on after;
  for longer than heartbeat_give_up_s: it fails (NOT_SERVING, exit 1) rather than serve unseen;
* Redis not there yet at start: it waits for it, then serves.

The blocked step is a real one: the test freezes the worker's `engine-step` thread with ptrace
(PTRACE_SEIZE + PTRACE_INTERRUPT stop that one thread; the event loop runs on), so the next step
the loop hands it never returns.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_worker_service import (  # noqa: F401  (model_dir, reference: fixtures used here)
    MODEL,
    Worker,
    completion,
    dispatch,
    events,
    make_item,
    model_dir,
    prompt,
    reference,
    wait_final,
)

from llmserve.local.valkey import ValkeyServer, free_port
from llmserve.protocol import keys

pytestmark = pytest.mark.timeout(300)

_PTRACE_SEIZE, _PTRACE_INTERRUPT = 0x4206, 0x4207
_WALL = 0x40000000


def freeze_thread(tid: int) -> threading.Thread:
    """Stop one thread of a child process (ptrace); the returned thread reaps it when the process ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(_PTRACE_SEIZE, tid, None, None) != 0:
        err = ctypes.get_errno()
        if err == errno.EPERM:
            pytest.skip("ptrace is not permitted here (yama ptrace_scope or seccomp)")
        raise OSError(err, os.strerror(err))
    assert libc.ptrace(_PTRACE_INTERRUPT, tid, None, None) == 0, os.strerror(ctypes.get_errno())

    def reap() -> None:      # a traced thread is the tracer's to wait for: its stop, then its exit
        while True:
            _, status = os.waitpid(tid, _WALL)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                return

    reaper = threading.Thread(target=reap, daemon=True)
    reaper.start()
    return reaper


def thread_id(pid: int, name: str) -> int:
    for task in Path(f"/proc/{pid}/task").iterdir():
        if (task / "comm").read_text().strip() == name:
            return int(task.name)
    raise LookupError(f"no thread {name} in process {pid}")


def watch_health(port: int) -> list[str]:
    """The statuses the worker's health Watch stream reports, appended as they come (a thread)."""
    seen: list[str] = []

    def watch() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
                    seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.RpcError as exc:
                seen.append(f"closed: {exc.code().name}")

    threading.Thread(target=watch, daemon=True).start()
    return seen


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def own_valkey():
    """A Valkey of this test's own (its memory limit is changed)."""
    server = ValkeyServer().start()
    yield server
    server.close()


def test_blocked_step_fails_the_worker_not_serving_first(own_valkey, model_dir, tmp_path):
    client = redis.Redis.from_url(own_valkey.url)
    port_file = tmp_path / "worker.port"
    worker = Worker(own_valkey.url, model_dir, "w-hung", "--step-timeout-s", "2", "--port-file", str(port_file))
    try:
        worker.wait_ready(client)
        statuses = watch_health(int(port_file.read_text()))
        wait_for(lambda: statuses[-1:] == ["SERVING"], what=f"SERVING (seen {statuses})")
        serving_at = len(statuses)
        reaper = freeze_thread(thread_id(worker.proc.pid, "engine-step"))
        dispatch(client, "w-hung", [make_item("stuck", prompt(8, 1), 4)])
        assert worker.wait_exit() == 1
        reaper.join(10)
        stderr = worker.proc.stderr.read()
    finally:
        worker.kill()
    assert statuses[serving_at:serving_at + 1] == ["NOT_SERVING"], statuses   # before the exit closed it
    assert worker.heartbeat(client) is None          # deleted: the batcher reclaims the inbox at once
    assert "StepTimeout" in stderr and "task died" in stderr, stderr[-3000:]
    client.close()


def test_redis_out_of_memory_for_5s_then_the_worker_serves_again(own_valkey, model_dir, reference):
    client = redis.Redis.from_url(own_valkey.url)
    worker = Worker(own_valkey.url, model_dir, "w-oom")
    try:
        worker.wait_ready(client)
        before = make_item("before", prompt(12, 2), 400)
        dispatch(client, "w-oom", [before])
        wait_for(lambda: events(client, before), what="first event")
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.set("probe", "x")                     # writes are refused from here on
            time.sleep(5.0)
            assert worker.proc.poll() is None
        finally:
            client.config_set("maxmemory", "0")
        oom_over = int(time.time() * 1000)
        wait_for(lambda: (hb := worker.heartbeat(client)) is not None and hb.sent_unix_ms > oom_over,
                 what="a heartbeat after the OOM")
        after = make_item("after", prompt(9, 3), 20)
        dispatch(client, "w-oom", [after], "b-after")
        wait_final(client, [before, after])
        for item, want in zip((before, after), reference([before, after])):
            assert completion(events(client, item)) == want
        assert worker.proc.poll() is None
    finally:
        worker.kill()
        client.close()


def test_heartbeats_refused_past_the_give_up_time_fail_the_worker(own_valkey, model_dir, tmp_path):
    client = redis.Redis.from_url(own_valkey.url)
    port_file = tmp_path / "worker.port"
    worker = Worker(own_valkey.url, model_dir, "w-unseen", "--heartbeat-give-up-s", "1", "--port-file", str(port_file))
    try:
        worker.wait_ready(client)
        statuses = watch_health(int(port_file.read_text()))
        wait_for(lambda: statuses[-1:] == ["SERVING"], what="SERVING")
        serving_at = len(statuses)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        try:
            assert worker.wait_exit() == 1
        finally:
            client.config_set("maxmemory", "0")
        stderr = worker.proc.stderr.read()
    finally:
        worker.kill()
        client.close()
    assert statuses[serving_at:serving_at + 1] == ["NOT_SERVING"], statuses
    assert "OutOfMemoryError" in stderr and "task died" in stderr, stderr[-3000:]


def test_worker_started_before_redis_waits_for_it(model_dir):
    server = ValkeyServer(port=free_port())
    worker = Worker(server.url, model_dir, "w-early")
    try:
        time.sleep(3.0)                                      # a few connection attempts fail meanwhile
        assert worker.proc.poll() is None
        server.start()
        with redis.Redis.from_url(server.url) as client:
            hb = worker.wait_ready(client)
            assert hb.worker_id == "w-early" and client.hexists(keys.workers_hash(MODEL), "w-early")
    finally:
        worker.kill()
        server.close()
