"""Fault tests: each test gets a whole stack of its own (`start_stack`: real Valkey, real model on CPU)."""

from __future__ import annotations

import pytest
import redis

from llmserve.local.stack import Stack
from llmserve.protocol import keys


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
