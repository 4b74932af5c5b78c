"""Logprobs through kill -9 of a worker mid-stream: greedy streams with logprobs on give the
fault-free run's tokens and logprobs. The gateway keeps the entries it already streamed; the ones
the reclaimed re-run computes on the other worker (from the start, in another batch) must agree.

Tolerance 1e-4 on a logprob: the re-run's batches differ, so the float sums behind a logit may be
ordered differently; identical tokens are asserted exactly.
"""

from __future__ import annotations

import threading
import uuid

import grpc
import pytest

from llmserve.stack import Stack, StackConfig
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc
from tests.conftest import TEST_TENANTS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

AUTH = (("authorization", "Bearer dev-key"),)
PROMPTS = ["Write a poem about the sea.", "Explain how a bicycle works.", "List some fruits and colors.",
           "Tell me about the history of Rome."]
TOL = 1e-4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = StackConfig(workers=2, device="cpu", port=0, http_port=0, tenants=TEST_TENANTS,
                         log_dir=tmp_path_factory.mktemp("logprobs-failover"))
    running = Stack(config).start()
    yield running
    running.close()


def request(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"lp-{uuid.uuid4().hex[:10]}",
                              messages=[pb.ChatMessage(role="user", content=prompt)],
                              sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True,
                                                         logprobs=True, top_logprobs=3))


class Streams:
    """The PROMPTS streamed at once, each in a thread; `started` once every one has its first chunk."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.results: dict[int, list[pb.GenerateResponse]] = {}
        self.errors: list[BaseException] = []
        self.started = threading.Barrier(len(PROMPTS) + 1)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(PROMPTS))]

    def _run(self, i: int) -> None:
        chunks: list[pb.GenerateResponse] = []
        try:
            for chunk in self.stub.Generate(request(PROMPTS[i]), metadata=AUTH, timeout=600):
                chunks.append(chunk)
                if len(chunks) == 2:
                    self.started.wait(timeout=600)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
        self.results[i] = chunks

    def start(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def join(self) -> list[tuple[list[int], list[pb.TokenLogprob]]]:
        for t in self.threads:
            t.join(timeout=600)
        self.channel.close()
        assert not self.errors, self.errors
        return [([t for c in self.results[i] for t in c.token_ids], [e for c in self.results[i] for e in c.logprobs])
                for i in range(len(PROMPTS))]


def assert_same(run, baseline) -> None:
    for (ids, entries), (base_ids, base_entries) in zip(run, baseline):
        assert ids == base_ids and len(entries) == len(ids) == 64
        for got, want in zip(entries, base_entries):
            assert (got.token_id, [t.token_id for t in got.top]) == (want.token_id, [t.token_id for t in want.top])
            assert abs(got.logprob - want.logprob) <= TOL
            assert all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(got.top, want.top))


def test_kill9_mid_stream_keeps_the_fault_free_logprobs(stack: Stack, inbox_pending):
    baseline = Streams(stack.gateway_target).start()
    baseline.started.wait(timeout=600)
    baseline = baseline.join()
    running = Streams(stack.gateway_target).start()
    running.started.wait(timeout=600)
    pending = inbox_pending(stack)
    victim = max(pending, key=pending.get)
    assert pending[victim] > 0, pending
    stack.kill(victim)
    assert_same(running.join(), baseline)
