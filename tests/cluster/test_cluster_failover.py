"""A worker process on a real Valkey Cluster with a replica per master, while the master of its
queue cell changes under a running request: by CLUSTER FAILOVER on the replica, and by kill -9
of the master. The worker carries on (same process, heartbeating), the running request
completes with the reference tokens and no gap, and a request dispatched after completes too.
The test plays gateway and batcher, as tests/integration/test_worker_service.py does."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from redis.crc import key_slot
from valkey_cluster import ValkeyCluster

from llmserve.protocol import keys
from llmserve.runtime import redis_client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
from test_worker_service import (  # noqa: E402,F401  (model_dir, reference: fixtures used here)
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

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def replicated_cluster():
    cluster = ValkeyCluster(masters=3, replicas=3, node_timeout_ms=1000).start()
    yield cluster
    cluster.close()


@pytest.mark.parametrize("change,whose", [("fail_over", "own"), ("kill_master", "own"), ("kill_master", "other")])
def test_worker_carries_on_through_a_master_change(replicated_cluster, model_dir, reference, change, whose):
    """`whose`: the master of the worker's cell, or another one (until its replica takes over, the
    whole cluster answers CLUSTERDOWN: cluster-require-full-coverage)."""
    cluster = replicated_cluster
    client = redis_client.connect_sync(cluster.url)
    worker = Worker(cluster.url, model_dir, f"w-{change}")
    try:
        worker.wait_ready(client)
        running = make_item("running", prompt(11, 4), 600)
        dispatch(client, worker.worker_id, [running])
        deadline = time.monotonic() + 60
        while not events(client, running) and time.monotonic() < deadline:
            time.sleep(0.02)
        own = cluster.node_of(key_slot(keys.inbox_stream(MODEL, worker.worker_id).encode()))
        master = own if whose == "own" else next(m for m in cluster.masters if m is not own)
        getattr(cluster, change)(master)
        client.close()
        client = redis_client.connect_sync(cluster.replica_of(master).url)   # the old master may be gone
        after = make_item("after", prompt(7, 5), 20)
        dispatch(client, worker.worker_id, [after], "b-after")
        try:
            wait_final(client, [running, after])
        except TimeoutError:
            worker.kill()
            finals = {i.request_id: [e.final for e in events(client, i)][-1:] for i in (running, after)}
            pytest.fail(f"no final event ({finals}); worker log:\n{worker.proc.stderr.read()[-6000:]}")
        for item, want in zip((running, after), reference([running, after])):
            assert completion(events(client, item)) == want
        assert worker.proc.poll() is None
        changed_at = int(time.time() * 1000)
        deadline = time.monotonic() + 30
        while worker.heartbeat(client).sent_unix_ms <= changed_at:
            assert time.monotonic() < deadline, "no heartbeat after the master change"
            time.sleep(0.05)
    finally:
        worker.kill()
        client.close()
    seen = sorted(set(re.findall(r'"error": "([^"]*)"', worker.proc.stderr.read())))
    print(f"\n{change} of the {whose} master: the worker retried {seen}")   # other: CLUSTERDOWN among them
