"""Shared fixtures: a real Valkey server, the real model file, tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from llmserve.catalog import model_store
from llmserve.local.valkey import ValkeyServer

# Test tenants: "dev" (key "dev-key"), "fuzz", "other", "restricted"; see the file's header.
TEST_TENANTS = Path(__file__).resolve().parent / "data" / "tenants.test.yaml"


@pytest.fixture(scope="session")
def valkey():
    """One real valkey-server for the whole session; tests flush what they use."""
    server = ValkeyServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_url(valkey) -> str:
    return valkey.url


@pytest.fixture
def clean_redis(valkey):
    """A sync client on a freshly flushed database."""
    client = redis.Redis.from_url(valkey.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct GGUF (fetched once into the cache)."""
    return model_store.fetch()


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """The whole stack on the real model, shared by every end-to-end test of the session."""
    from llmserve.local.stack import Stack, StackConfig

    config = StackConfig(workers=1, device="cpu", port=0, http_port=-1, tenants=TEST_TENANTS,
                         log_dir=tmp_path_factory.mktemp("stack"))
    running = Stack(config).start()
    yield running
    running.close()


@pytest.fixture
def own_gateways(stack):
    """The shared stack (under tests/cluster the cluster one), whose gateways started during the test
    (stack.start_gateway) are stopped and forgotten after it, killed ones too, so later modules find
    the stack as it was."""
    before = set(stack.services)
    yield stack
    for name in set(stack.services) - before:
        stack.retire(name)


@pytest.fixture
def start_stack(tmp_path_factory):
    """start_stack(workers=2, gateways=1, **StackConfig fields) -> a started Stack of its own (real
    Valkey, real model on CPU), closed after the test."""
    from llmserve.local.stack import Stack, StackConfig

    stacks: list[Stack] = []

    def start(**overrides) -> Stack:
        config = StackConfig(**{"workers": 2, "device": "cpu", "port": 0, "tenants": TEST_TENANTS,
                                "log_dir": tmp_path_factory.mktemp("own-stack"), **overrides})
        stack = Stack(config)
        stacks.append(stack)
        return stack.start()

    yield start
    for stack in stacks:
        stack.close()


DEV_API_KEY = "dev-key"


@pytest.fixture(scope="session")
def auth_metadata():
    return (("authorization", f"Bearer {DEV_API_KEY}"),)
