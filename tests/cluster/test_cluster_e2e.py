"""The end-to-end core on a real three-master Valkey Cluster: one stack (2 workers, 2 gateways)
whose services were given one node's URL and found the others themselves.

The Paris, batch-invariance, cancel and resume tests are the e2e suite's own, imported and run
here on the cluster stack (tests/cluster/conftest.py overrides `stack`), whose queue is two cells
(llmserve/protocol/keys.py): each worker joins its own, requests spread over both, and the kill -9 of a
worker leaves its cell with no worker, so its work must move to the other cell. The last test checks
that nothing crossed a hash slot: no CROSSSLOT reply on any node, no failed script or MULTI,
no cross-slot refusal by the client in any service's log, and traffic on every node.
"""

from __future__ import annotations

import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from llmserve.loadgen.streams import PROMPTS, StreamLoad, mismatches
from llmserve.protocol import keys
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from test_gateway_e2e import (  # noqa: E402,F401  (collected and run here, on the cluster stack)
    story,
    test_cancel_rpc_stops_the_workers_sequence,
    test_resume_after_kill_9_of_gateway_mid_stream,
)
from test_thin_path import (  # noqa: E402,F401
    test_concurrent_requests_match_their_solo_runs,
    test_generate_streams_paris,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CAPPED = (("authorization", "Bearer capped-key"),)   # burst 3 at 1/s, max_concurrent 2
CAPPED_BURST, CAPPED_RATE = 3, 1.0
# What a service logs when the cluster client or a node refuses a command that spans slots.
CROSS_SLOT_MARKERS = ("CROSSSLOT", "must map to the same key slot", "non local key", "Too many targets")


@pytest.fixture(scope="module")
def inference(stack):
    channel = grpc.insecure_channel(stack.gateway_target)
    yield inference_pb2_grpc.InferenceStub(channel)
    channel.close()


def stubs(stack) -> list[inference_pb2_grpc.InferenceStub]:
    return [inference_pb2_grpc.InferenceStub(grpc.insecure_channel(t)) for t in stack.gateway_targets[:2]]


def test_both_workers_heartbeat_into_the_cluster_each_in_its_own_cell(stack, valkey_client):
    cells = worker_cells(valkey_client, stack)
    assert set(cells) == {"gpu_worker-0", "gpu_worker-1"} and set(cells.values()) == {0, 1}, cells
    slots = {valkey_client.keyslot(keys.workers_hash(stack.model_id, shard)) for shard in (0, 1)}
    assert len(slots) == 2


def test_requests_spread_over_both_cells(stack, inference, auth_metadata, valkey_client):
    rids = [f"cells-{i}-{uuid.uuid4().hex[:6]}" for i in range(16)]
    for rid in rids:
        inference.Complete(pb.GenerateRequest(prompt="Hi", request_id=rid, sampling=pb.SamplingParams(
            max_new_tokens=1, temperature=0.0)), metadata=auth_metadata, timeout=120)
    work_keys = [valkey_client.hget(keys.request_meta("dev", rid), "work_key").decode() for rid in rids]
    used = {shard for shard in (0, 1) for k in work_keys if keys.queue_tag(stack.model_id, shard) in k}
    assert used == {0, 1}, work_keys


def worker_cells(client, stack) -> dict[str, int]:
    """Worker id -> the queue cell whose heartbeat hash holds it."""
    return {k.decode(): shard for shard in range(stack.queue_shards)
            for k in client.hkeys(keys.workers_hash(stack.model_id, shard))}


def test_quotas_hold_across_two_gateways(stack):
    first, second = stubs(stack)
    held = [first.Generate(story(f"capped-{i}-{uuid.uuid4().hex[:6]}"), metadata=CAPPED, timeout=300)
            for i in range(2)]
    for call in held:
        next(call)                                     # both admitted and streaming
    with pytest.raises(grpc.RpcError) as err:          # a third, through the other gateway
        second.Complete(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=2)),
                        metadata=CAPPED, timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in err.value.details()
    for call in held:
        call.cancel()

    def tokenize(i: int) -> bool:
        try:
            (first, second)[i % 2].Tokenize(pb.TokenizeRequest(text="hello"), metadata=CAPPED, timeout=60)
            return True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            return False

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        admitted = sum(pool.map(tokenize, range(24)))
    elapsed = time.monotonic() - started
    # The rate state is shared by both gateways: never above GCRA's bound (2 of the burst
    # may already be spent by the held streams), and some calls refused.
    assert 1 <= admitted <= CAPPED_BURST + int(CAPPED_RATE * elapsed) + 1
    assert admitted < 24


def test_kill9_of_a_worker_loses_nothing(stack, valkey_client):
    load = StreamLoad(stack.gateway_target, "dev-key", PROMPTS[:8], max_new_tokens=24)
    baseline = load.run("cluster-base")
    running = load.start("cluster-kill9")
    running.wait_started(4)
    cells = worker_cells(valkey_client, stack)
    pending = {w.name: inbox_pending(valkey_client, stack.model_id, w.name, cells[w.name])
               for w in stack.named("gpu_worker-")}
    victim = max(pending, key=pending.get)
    assert pending[victim] > 0, pending
    stack.kill(victim)
    records = running.join()
    assert mismatches(records, baseline) == []


def inbox_pending(client, model_id: str, worker: str, shard: int) -> int:
    try:
        return int(client.xpending(keys.inbox_stream(model_id, worker, shard), keys.INBOX_GROUP)["pending"])
    except redis.ResponseError:   # no stream or group yet
        return 0


def test_no_command_crossed_a_slot_and_every_node_served(stack, valkey_cluster):
    errors = valkey_cluster.error_stats()
    assert not any("CROSSSLOT" in e for node in errors.values() for e in node), errors
    logs = "\n".join(p.read_text(errors="replace") for p in Path(stack.log_dir).glob("*.log"))
    assert [m for m in CROSS_SLOT_MARKERS if m in logs] == []
    for node in valkey_cluster.nodes:
        with node.client() as c:
            stats = c.info("commandstats")
            noscript = int(c.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0))
        failed = {cmd: stats.get(f"cmdstat_{cmd}", {}).get("failed_calls", 0) for cmd in ("eval", "exec", "evalsha")}
        assert failed["eval"] == 0 and failed["exec"] == 0 and failed["evalsha"] <= noscript, (node.port, failed)
        assert stats.get("cmdstat_eval", {}).get("calls", 0) > 0, f"node {node.port} wrote no token events"
