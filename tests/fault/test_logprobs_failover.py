"""Logprobs and n choices through faults mid-stream, each against a fault-free run of the same requests:

- SIGTERM drain with drain timeout 0: seeded n = 2 streams are handed back mid-stream, both choices
  of a request in one item (WorkItem.choices), and go on on the replacement worker;
- kill -9 of one of two workers: greedy streams are reclaimed and re-run from the start elsewhere.

The gateway keeps the entries it already streamed; the ones computed after the fault must agree.

Tolerance 1e-4 on a logprob: the re-run's batches differ, so the float sums behind a logit may be
ordered differently; identical tokens are asserted exactly.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable

import grpc
import pytest

from llmserve.local.stack import Stack, StackConfig
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
                         log_dir=tmp_path_factory.mktemp("logprobs-failover"),
                         extra_flags={"gpu_worker": ["--drain-timeout-s", "0"]})
    running = Stack(config).start()
    yield running
    running.close()


def greedy(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"lp-{uuid.uuid4().hex[:10]}",
                              messages=[pb.ChatMessage(role="user", content=prompt)],
                              sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True,
                                                         logprobs=True, top_logprobs=3))


def seeded_pair(prompt: str) -> pb.GenerateRequest:
    request = greedy(prompt)
    request.n, request.sampling.temperature, request.sampling.seed = 2, 0.8, 99
    return request


class Streams:
    """The PROMPTS streamed at once, each in a thread; `started` once every one has its first chunk."""

    def __init__(self, target: str, make: Callable[[str], pb.GenerateRequest]) -> None:
        self.make = make
        self.channel = grpc.insecure_channel(target)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.results: dict[int, list[pb.GenerateResponse]] = {}
        self.errors: list[BaseException] = []
        self.started = threading.Barrier(len(PROMPTS) + 1)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(PROMPTS))]

    def _run(self, i: int) -> None:
        chunks: list[pb.GenerateResponse] = []
        try:
            for chunk in self.stub.Generate(self.make(PROMPTS[i]), metadata=AUTH, timeout=600):
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
        """(token ids, logprobs) of each prompt's each choice."""
        for t in self.threads:
            t.join(timeout=600)
        self.channel.close()
        assert not self.errors, self.errors
        out = []
        for i in range(len(PROMPTS)):
            for choice in sorted({c.choice_index for c in self.results[i]}):
                chunks = [c for c in self.results[i] if c.choice_index == choice]
                out.append(([t for c in chunks for t in c.token_ids], [e for c in chunks for e in c.logprobs]))
        return out


def fault_free(stack: Stack, make: Callable[[str], pb.GenerateRequest]):
    streams = Streams(stack.gateway_target, make).start()
    streams.started.wait(timeout=600)
    return streams.join()


def busiest(stack: Stack, inbox_pending) -> str:
    pending = inbox_pending(stack)
    victim = max(pending, key=pending.get)
    assert pending[victim] > 0, pending
    return victim


def assert_same(run, baseline) -> None:
    for (ids, entries), (base_ids, base_entries) in zip(run, baseline):
        assert ids == base_ids and len(entries) == len(ids) == 64
        for got, want in zip(entries, base_entries):
            assert (got.token_id, [t.token_id for t in got.top]) == (want.token_id, [t.token_id for t in want.top])
            assert abs(got.logprob - want.logprob) <= TOL
            assert all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(got.top, want.top))


def test_sigterm_drain_hands_both_choices_back_mid_stream(stack: Stack, inbox_pending):
    baseline = fault_free(stack, seeded_pair)
    assert len(baseline) == 2 * len(PROMPTS)
    running = Streams(stack.gateway_target, seeded_pair).start()
    running.started.wait(timeout=600)
    worker = stack.services[busiest(stack, inbox_pending)]
    worker.signal(signal.SIGTERM)
    replacement = stack.start_worker()
    assert_same(running.join(), baseline)
    assert worker.wait(120) == 0, worker.log_tail()
    handed = [json.loads(line) for line in worker.log_path.read_text().splitlines() if '"handed back"' in line]
    assert handed and handed[-1]["items"] > 0, handed   # the choices moved mid-stream, not finished in place
    replacement.wait_serving(time.monotonic() + 300)


def test_kill9_mid_stream_keeps_the_fault_free_logprobs(stack: Stack, inbox_pending):
    baseline = fault_free(stack, greedy)
    running = Streams(stack.gateway_target, greedy).start()
    running.started.wait(timeout=600)
    stack.kill(busiest(stack, inbox_pending))
    assert_same(running.join(), baseline)
