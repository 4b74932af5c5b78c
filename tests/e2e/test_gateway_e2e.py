"""Gateway behaviour that needs the whole stack (real tokenizer_svc, batcher and
gpu_worker processes on the real SmolLM2): cancel, disconnect and deadline stop
the worker's sequence; resume after kill -9 of a gateway mid-stream."""

import time
import uuid

import grpc
import pytest

from llmserve.client import Client
from llmserve.protocol import keys
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc, queue_pb2

pytestmark = pytest.mark.e2e

STORY = [pb.ChatMessage(role="user", content="Write a long story about a dragon who learns to bake bread.")]
GREEDY_LONG = pb.SamplingParams(temperature=0.0, max_new_tokens=160)
# 2048 tokens (the dev tenant's most) without EOS: about 20 s at the fastest this CPU stack decodes,
# so a cancel, a disconnect or a 2 s deadline always comes first, however fast the engine gets
UNFINISHABLE = pb.SamplingParams(temperature=0.0, max_new_tokens=2048, ignore_eos=True)


def running_sequences(client, model_id, queue_shards: int = 1) -> int:
    beats = [queue_pb2.WorkerHeartbeat.FromString(v) for shard in range(queue_shards)
             for v in client.hgetall(keys.workers_hash(model_id, shard)).values()]
    return sum(b.running + b.waiting for b in beats)


def wait_until(predicate, timeout_s=60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def story(request_id) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=STORY, sampling=GREEDY_LONG, request_id=request_id)


def endless_story(request_id) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=STORY, sampling=UNFINISHABLE, request_id=request_id)


def test_cancel_rpc_stops_the_workers_sequence(inference, auth_metadata, valkey_client, stack):
    rid = "e2e-cancel-" + uuid.uuid4().hex[:8]
    call = inference.Generate(endless_story(rid), metadata=auth_metadata, timeout=300)
    chunks = [next(call) for _ in range(3)]
    assert wait_until(lambda: running_sequences(valkey_client, stack.model_id, stack.queue_shards) >= 1, 30)
    inference.Cancel(pb.CancelRequest(request_id=rid), metadata=auth_metadata, timeout=10)
    chunks += list(call)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    assert chunks[-1].usage.completion_tokens < UNFINISHABLE.max_new_tokens
    assert wait_until(lambda: running_sequences(valkey_client, stack.model_id, stack.queue_shards) == 0)


def test_disconnect_stops_the_workers_sequence(inference, auth_metadata, valkey_client, stack):
    rid = "e2e-gone-" + uuid.uuid4().hex[:8]
    call = inference.Generate(endless_story(rid), metadata=auth_metadata, timeout=300)
    next(call)
    call.cancel()
    assert wait_until(lambda: valkey_client.exists(keys.cancel_key("dev", rid)) == 1, 30)
    assert wait_until(lambda: running_sequences(valkey_client, stack.model_id, stack.queue_shards) == 0)


def test_deadline_exceeded_in_time_and_worker_stops(inference, auth_metadata, valkey_client, stack):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(inference.Generate(endless_story("e2e-deadline-" + uuid.uuid4().hex[:8]), metadata=auth_metadata,
                                timeout=2.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 30
    assert wait_until(lambda: running_sequences(valkey_client, stack.model_id, stack.queue_shards) == 0)


def test_resume_after_kill_9_of_gateway_mid_stream(inference, auth_metadata, own_gateways):
    reference = inference.Complete(story("e2e-ref-" + uuid.uuid4().hex[:8]), metadata=auth_metadata, timeout=300)
    doomed = own_gateways.start_gateway()
    doomed.wait_serving(time.monotonic() + 120)
    rid = "e2e-resume-" + uuid.uuid4().hex[:8]
    with grpc.insecure_channel(doomed.target) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(story(rid), metadata=auth_metadata, timeout=300)
        before = [next(call) for _ in range(4)]
        own_gateways.kill(doomed.name)
        with pytest.raises(grpc.RpcError):
            list(call)
    next_index = before[-1].index + len(before[-1].token_ids)
    after = list(inference.Generate(story(rid), metadata=auth_metadata + (("x-resume-from", str(next_index)),),
                                    timeout=300))
    chunks = before + after
    expected = 0
    for c in chunks:
        assert c.index == expected                          # no duplicate, no gap
        expected += len(c.token_ids)
    assert [t for c in chunks for t in c.token_ids] == list(reference.token_ids)
    assert "".join(c.text for c in chunks) == reference.text
    assert chunks[-1].finish_reason == reference.finish_reason


def test_client_sdk_resumes_across_gateway_restart(auth_metadata, own_gateways):
    """kill -9 the client's gateway, start a new one on the same port: the SDK resumes by itself."""
    doomed = own_gateways.start_gateway()
    doomed.wait_serving(time.monotonic() + 120)
    client = Client(doomed.target, api_key="dev-key")
    reference = client.complete(messages=[{"role": "user", "content": STORY[0].content}], temperature=0.0,
                                max_new_tokens=GREEDY_LONG.max_new_tokens, timeout=300)
    chunks = []
    for chunk in client.generate(messages=[{"role": "user", "content": STORY[0].content}], temperature=0.0,
                                 max_new_tokens=GREEDY_LONG.max_new_tokens, timeout=300):
        chunks.append(chunk)
        if len(chunks) == 4:
            own_gateways.kill(doomed.name)
            # the replacement is serving before the client's next read, so its retry budget is not what is tested
            own_gateways.start_gateway(doomed.port).wait_serving(time.monotonic() + 120)
    client.close()
    assert [c.index for c in chunks] == [sum(len(x.token_ids) for x in chunks[:i]) for i in range(len(chunks))]
    assert "".join(c.text for c in chunks) == reference.text
    assert [t for c in chunks for t in c.token_ids] == list(reference.token_ids)
