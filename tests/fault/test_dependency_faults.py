"""Dependency faults under ≥16 concurrent streams: Valkey (AOF) stopped for 3 s then restarted,
and the tokenizer service killed and restarted. Services stay up, answer UNAVAILABLE (not a hang)
while Valkey is down, and every request ends with the fault-free run's tokens."""

from __future__ import annotations

import time

import grpc
import pytest

from llmserve.loadgen.streams import PROMPTS, StreamLoad, mismatches, stall_s
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STREAMS = 16
MAX_NEW_TOKENS = 24
AUTH = (("authorization", "Bearer dev-key"),)
PROBE = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=1))


def probe(target: str, timeout_s: float) -> tuple[grpc.StatusCode, float]:
    """One short Complete: its status and how long the call took."""
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        try:
            inference_pb2_grpc.InferenceStub(channel).Complete(PROBE, metadata=AUTH, timeout=timeout_s)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
    return code, time.monotonic() - start


def until_ok(target: str, limit_s: float) -> float:
    """Seconds until a probe succeeds (probing every 0.1 s); fails the test after limit_s."""
    start = time.monotonic()
    while probe(target, 5.0)[0] != grpc.StatusCode.OK:
        assert time.monotonic() - start < limit_s, "no recovery"
        time.sleep(0.1)
    return time.monotonic() - start


def test_valkey_outage_of_3s(start_stack):
    stack = start_stack(workers=1, redis_appendonly=True)
    load = StreamLoad(stack.gateway_target, "dev-key", PROMPTS[:STREAMS], max_new_tokens=MAX_NEW_TOKENS)
    baseline = load.run("base")
    running = load.start("outage")
    running.wait_started(STREAMS // 2)
    stack.valkey.stop()
    fault_at = time.monotonic()
    during = [probe(stack.gateway_target, 2.0) for _ in range(3)]
    time.sleep(max(0.0, fault_at + 3.0 - time.monotonic()))
    stack.valkey.start()
    recovery_s = until_ok(stack.gateway_target, 60.0)
    records = running.join()
    print(f"\nvalkey down 3 s: probes during {[(c.name, round(t, 2)) for c, t in during]}, "
          f"recovered {recovery_s:.2f} s after restart, longest client stall {stall_s(records, fault_at):.2f} s")
    assert {code for code, _ in during} <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert all(s.alive() for s in stack.services.values()), [s.name for s in stack.services.values()]
    assert mismatches(records, baseline) == []


def test_tokenizer_killed_and_restarted(start_stack):
    stack = start_stack(workers=1)
    load = StreamLoad(stack.gateway_target, "dev-key", PROMPTS[STREAMS:2 * STREAMS], max_new_tokens=MAX_NEW_TOKENS)
    tokenizer = stack.services["tokenizer_svc"]
    stack.kill("tokenizer_svc")
    fault_at = time.monotonic()
    running = load.start("tokenizer-down")       # these arrive while the tokenizer is down
    time.sleep(1.0)
    tokenizer.start()                            # same flags, same port
    tokenizer.wait_serving(time.monotonic() + 120)
    records = running.join()
    baseline = load.run("base")                  # afterwards, so no cache could answer the run above
    assert mismatches(records, baseline) == []
    assert all(s.alive() for s in stack.services.values())
    print(f"\ntokenizer killed: longest client wait {max(r.chunk_times_s[0] - r.start_s for r in records):.2f} s")
    assert stall_s(records, fault_at) is not None
