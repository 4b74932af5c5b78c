"""Faults as an operator meets them: `llmserve up` as a process (2 CPU workers, real Valkey,
real model), 12 concurrent seeded streams at temperature 0.8, and the fault from outside.

Each test asserts that every stream completes with exactly the text of a fault-free run
(contiguous indices, no splice of two runs), that `up` and the rest of the stack keep
serving, and that the worker count is whole again within 90 s; it prints the longest
client stall and the time until the fleet was whole. Each also asserts what its fault
is for: a drain hands sequences over, a roll takes one worker at a time, a poison entry
is acked, deleted and counted, a killed Valkey comes back with every accepted request.
One `up` serves the whole module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.catalog import model_store
from llmserve.client import Client, RetryPolicy
from llmserve.loadgen.streams import PROMPTS, StreamLoad, mismatches, stall_s
from llmserve.protocol import keys, queue
from tests.conftest import TEST_TENANTS
from tests.fault.up_process import UpProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

WORKERS = 2
STREAMS = 12
MAX_NEW_TOKENS = 32
WHOLE_WITHIN_S = 90.0


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    # A drain of 1 s: the streams outlast it, so a drained worker hands sequences over part-way.
    process = UpProcess.start(tmp_path_factory.mktemp("up"), workers=WORKERS, tenants=TEST_TENANTS,
                              flags=("--drain-timeout-s", "1"))
    process.wait_workers(WORKERS, timeout_s=120)
    yield process
    assert process.stop() == 0, process.stderr_text()[-2000:]


@pytest.fixture(scope="module")
def load(up):
    return StreamLoad(up.gateway_target, "dev-key", PROMPTS[:STREAMS], max_new_tokens=MAX_NEW_TOKENS,
                      temperature=0.8)


@pytest.fixture(scope="module")
def baseline(load):
    records = load.run("baseline")
    assert mismatches(records, records) == []
    return records


@pytest.fixture(autouse=True)
def whole_fleet(up):
    """Every test starts (and must end) with every worker live and `up` running."""
    up.wait_workers(WORKERS, timeout_s=WHOLE_WITHIN_S)
    yield
    assert up.process.poll() is None, up.stderr_text()[-2000:]


def busiest_worker(up: UpProcess) -> str:
    """The worker with most inbox entries in progress (it holds running sequences)."""
    client = redis.Redis.from_url(up.redis_url)
    try:
        model = model_store.model_id(model_store.DEFAULT_MODEL)
        pending = {w: int(client.xpending(keys.inbox_stream(model, w), keys.INBOX_GROUP)["pending"])
                   for w in up.worker_pids()}
    finally:
        client.close()
    victim = max(pending, key=pending.get)
    assert pending[victim] > 0, pending
    return victim


def run_fault(up: UpProcess, load: StreamLoad, baseline, tag: str, fault):
    """Start the streams, apply `fault` once half have tokens, check the outcome.

    Returns:
        what `fault` returned (after the streams ended and the fleet was whole again).
    """
    running = load.start(tag)
    running.wait_started(STREAMS // 2)
    fault_at = time.monotonic()
    fleet = up.watch_fleet(WORKERS)
    result = fault()
    records = running.join()
    assert mismatches(records, baseline) == []
    whole_s = fleet.recovery_s(timeout_s=WHOLE_WITHIN_S)
    assert whole_s <= WHOLE_WITHIN_S
    stall = stall_s(records, fault_at) or 0.0
    print(f"\n{tag}: longest client stall {stall:.2f} s; worker count whole again {whole_s:.1f} s after the fault")
    return result


def signal_busiest(up: UpProcess, sig: int) -> tuple[str, int]:
    """Send `sig` to the worker holding most running batches; returns (its name, its pid)."""
    victim = busiest_worker(up)
    pid = up.worker_pids()[victim]
    os.kill(pid, sig)
    return victim, pid


def test_kill9_of_a_worker_is_replaced(up, load, baseline):
    victim, old_pid = run_fault(up, load, baseline, "kill9", lambda: signal_busiest(up, signal.SIGKILL))
    assert up.worker_pids()[victim] != old_pid
    assert f"{victim} exited with code -9" in up.stderr_text()


def log_events(log: str, msg: str) -> list[dict]:
    """The structured (JSON) lines of a service log whose msg is `msg`."""
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("msg") == msg]


def token_events(up: UpProcess, request_id: str) -> list:
    """Every token event of a request of tenant dev, in stream order (queue.decode_event)."""
    client = redis.Redis.from_url(up.redis_url)
    try:
        return [queue.decode_event(fields) for _, fields in client.xrange(keys.events_stream("dev", request_id))]
    finally:
        client.close()


def test_sigterm_drains_a_worker_and_up_replaces_it(up, load, baseline):
    logged = {name: len(up.service_log(name)) for name in up.worker_pids()}
    victim, old_pid = run_fault(up, load, baseline, "sigterm", lambda: signal_busiest(up, signal.SIGTERM))
    assert up.worker_pids()[victim] != old_pid
    assert f"{victim} exited with code 0" in up.stderr_text()
    (handoff,) = log_events(up.service_log(victim)[logged[victim]:], "handed back")
    assert handoff["items"] > 0, handoff
    for request_id in handoff["request_ids"]:
        events = token_events(up, request_id)
        dispatches = list(dict.fromkeys((e.worker_id, e.dispatch_epoch) for e in events))
        assert len(dispatches) >= 2 and dispatches[0][0] == victim, (request_id, dispatches)
        at = 0
        for event in events:                       # one run of indices across both workers: no gap, no repeat
            assert event.index == at, (request_id, [(e.worker_id, e.index, len(e.token_ids)) for e in events])
            at += len(event.token_ids)


def test_sighup_rolls_every_worker_one_at_a_time(up, load, baseline):
    before = up.worker_pids()
    said_before = len(up.stderr_text())
    watch = up.watch_fleet(WORKERS)
    run_fault(up, load, baseline, "sighup", lambda: up.signal(signal.SIGHUP))
    deadline = time.monotonic() + 300
    while "rolling restart done" not in up.stderr_text()[said_before:]:
        assert time.monotonic() < deadline, up.stderr_text()[-2000:]
        time.sleep(0.5)
    watch.recovery_s(timeout_s=WHOLE_WITHIN_S)
    assert watch.fewest_joined >= WORKERS - 1, "more than one worker was down at once"
    steps = [("drain", m[1]) if m[1] else ("replaced", m[2]) for m in
             re.finditer(r"^(?:draining (\S+)|(\S+) replaced .* SERVING)$", up.stderr_text()[said_before:], re.MULTILINE)]
    # each replacement SERVING before the next drain
    assert steps == [(step, name) for name in sorted(before) for step in ("drain", "replaced")], steps
    after = up.worker_pids()
    assert sorted(after) == sorted(before)
    assert all(after[name] != pid for name, pid in before.items()), (before, after)


def test_worker_paused_past_its_ttl_is_fenced(up, load, baseline):
    """SIGSTOP past the heartbeat TTL: its batches are reclaimed and re-run elsewhere; after
    SIGCONT its writes for those requests are refused (fencing), so no stream is spliced."""
    def pause() -> tuple[str, int]:
        victim, pid = signal_busiest(up, signal.SIGSTOP)
        time.sleep(6.0)                 # heartbeat TTL 3 s + reclaim sweep
        os.kill(pid, signal.SIGCONT)
        return victim, pid

    victim, pid = run_fault(up, load, baseline, "sigstop", pause)
    assert up.worker_pids()[victim] == pid          # it was paused, never restarted
    deadline = time.monotonic() + 30
    while "dispatched again elsewhere" not in up.service_log(victim):
        assert time.monotonic() < deadline, up.service_log(victim)[-3000:]
        time.sleep(0.5)


def inbox_dropped(up: UpProcess, worker: str) -> float:
    """The worker's llmserve_worker_inbox_dropped_total, scraped from its /metrics."""
    port = int((up.state_dir / "logs" / f"{worker}.metrics.port").read_text())
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^llmserve_worker_inbox_dropped_total (\S+)$", body, re.MULTILINE).group(1))


def test_undecodable_inbox_entry_is_acked_deleted_and_counted(up, load, baseline):
    victim = sorted(up.worker_pids())[0]
    pid = up.worker_pids()[victim]
    dropped_before = inbox_dropped(up, victim)
    client = redis.Redis.from_url(up.redis_url)
    inbox = keys.inbox_stream(model_store.model_id(model_store.DEFAULT_MODEL), victim)
    try:
        entry = run_fault(up, load, baseline, "poison",
                          lambda: client.xadd(inbox, {queue.BATCH_FIELD: b"\xff\x00 not a Batch"})).decode()
        deadline = time.monotonic() + 30
        while inbox_dropped(up, victim) == dropped_before:
            assert time.monotonic() < deadline, up.service_log(victim)[-3000:]
            time.sleep(0.2)
        assert inbox_dropped(up, victim) == dropped_before + 1
        assert client.xrange(inbox, entry, entry) == []                                     # deleted
        assert client.xpending_range(inbox, keys.INBOX_GROUP, entry, entry, 1) == []          # acked
    finally:
        client.close()
    assert up.worker_pids()[victim] == pid          # dropped, not crashed
    assert [e["entry_id"] for e in log_events(up.service_log(victim), "dropping undecodable inbox entry")
            if e["entry_id"] == entry] == [entry]


def test_kill9_of_valkey_loses_no_request_and_the_stack_heals(up, load, baseline):
    """kill -9 of the Valkey `up` started, under the streams: `up` restarts it on its port over
    its AOF (everysec: an acknowledged write is in the kernel before the reply), the services
    ride out the gap, the SDK re-attaches each stream from its next index (with its default
    retry policy, as a caller has it)."""
    old_pid = up.valkey_pid()
    sdk_default = StreamLoad(load.target, load.api_key, load.prompts, max_new_tokens=load.max_new_tokens,
                             retry=RetryPolicy(), temperature=load.temperature)
    run_fault(up, sdk_default, baseline, "valkey-kill9", lambda: os.kill(old_pid, signal.SIGKILL))
    assert "valkey exited with code -9" in up.stderr_text()
    assert up.valkey_pid() != old_pid
    with grpc.insecure_channel(up.gateway_target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with Client(up.gateway_target, api_key="dev-key") as client:
        reply = client.complete(prompt="After the outage:", max_new_tokens=4, temperature=0.0)
    assert reply.finish_reason in ("stop", "length")


def test_engine_loop_failure_takes_the_worker_down(up, load, baseline):
    """An unexpected error inside the engine loop: Redis loses the worker's consumer group (a
    failover to a replica that never got the XGROUP CREATE, or a stray DEL), so its next inbox
    read fails with NOGROUP. The loop dies; the worker logs it, deletes its heartbeat and exits 1;
    `up` starts a fresh one, which creates the group again and re-reads the batches still in its
    inbox, and the seeded streams finish as if nothing happened."""
    model = model_store.model_id(model_store.DEFAULT_MODEL)

    def lose_the_group() -> tuple[str, int]:
        victim = busiest_worker(up)
        pid = up.worker_pids()[victim]
        client = redis.Redis.from_url(up.redis_url)
        try:
            assert client.xgroup_destroy(keys.inbox_stream(model, victim), keys.INBOX_GROUP) == 1
        finally:
            client.close()
        return victim, pid

    victim, pid = run_fault(up, load, baseline, "lost-group", lose_the_group)
    assert up.worker_pids()[victim] != pid
    assert f"{victim} exited with code 1" in up.stderr_text()
    log = up.service_log(victim)
    assert "task died; failing the service" in log and '"task": "engine-loop"' in log and "NOGROUP" in log
