"""Prefix-aware dispatch on a real two-worker stack: a request whose system prompt one worker
already caches goes to that worker, even when the other has more free KV blocks."""

from __future__ import annotations

import time

import grpc
import pytest

from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SYSTEM = pb.ChatMessage(role="system", content=(
    "You are the support assistant of a small bicycle shop in Lyon. Answer in one short sentence. "
    "The shop opens at nine and closes at seven, Monday to Saturday. It repairs city bikes, road "
    "bikes and cargo bikes, sells second-hand frames, and rents tandems by the day. Never invent "
    "prices; say that the staff will confirm them."))


def test_shared_system_prompt_goes_to_the_worker_that_caches_it(start_stack, auth_metadata):
    stack = start_stack(workers=2)
    channel = grpc.insecure_channel(stack.gateway_target)
    inference = inference_pb2_grpc.InferenceStub(channel)

    def ask(question: str, max_new: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(messages=[SYSTEM, pb.ChatMessage(role="user", content=question)],
                                  sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new))

    try:
        # A long answer behind the system prompt: its worker computes (and caches) the system
        # prompt's blocks, then keeps blocks reserved while it generates, so the other worker
        # has more free blocks for the next request.
        busy = inference.Generate(ask("Describe every service of the shop in detail.", 400),
                                  metadata=auth_metadata, timeout=120)
        first = next(busy)
        time.sleep(1.5)                                 # a heartbeat now lists the cached blocks
        warm = inference.Complete(ask("Do you rent tandems?", 8), metadata=auth_metadata, timeout=120)
        busy.cancel()
        system_blocks = warm.usage.prompt_tokens // 16 - 1   # full blocks before the user turn
        assert system_blocks >= 4 and first.index == 0
        assert warm.usage.cached_prompt_tokens >= system_blocks * 16, warm.usage
    finally:
        channel.close()
