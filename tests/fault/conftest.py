"""Fault tests: each test gets a whole stack of its own (real Valkey, real model on CPU, short outputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from llmserve import keys
from llmserve.stack import Stack, StackConfig

TENANTS = Path(__file__).resolve().parents[1] / "data" / "tenants.test.yaml"
API_KEY = "dev-key"


@pytest.fixture
def start_stack(tmp_path_factory):
    """start_stack(workers=2, gateways=1, **StackConfig fields) -> a started Stack, closed after the test."""
    stacks: list[Stack] = []

    def start(**overrides) -> Stack:
        config = StackConfig(**{"workers": 2, "device": "cpu", "port": 0, "tenants": TENANTS,
                                "log_dir": tmp_path_factory.mktemp("fault-stack"), **overrides})
        stack = Stack(config)
        stacks.append(stack)
        return stack.start()

    yield start
    for stack in stacks:
        stack.close()


@pytest.fixture
def inbox_pending():
    """inbox_pending(stack) -> {worker name: inbox entries read but not yet acknowledged (running batches)}."""
    def pending(stack: Stack) -> dict[str, int]:
        client = redis.Redis.from_url(stack.redis_url)
        try:
            return {w.name: _pending(client, keys.inbox_stream(stack.model_id, w.name))
                    for w in stack.named("gpu_worker-") if w.alive()}
        finally:
            client.close()

    return pending


def _pending(client: redis.Redis, stream: str) -> int:
    try:
        return int(client.xpending(stream, keys.INBOX_GROUP)["pending"])
    except redis.ResponseError:   # no stream or group yet
        return 0
