"""Clients of the shared stack (tests/conftest.py `stack`), one set per test module."""

import grpc
import openai
import pytest
import redis

from llmserve.v1 import inference_pb2_grpc


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    """The official OpenAI client on the stack's HTTP port, as the dev tenant."""
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="dev-key", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def inference(stack):
    """A gRPC stub of the stack's gateway (calls pass their own metadata)."""
    channel = grpc.insecure_channel(stack.gateway_target)
    yield inference_pb2_grpc.InferenceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def valkey_client(stack):
    """A client of the stack's Valkey, to read what the services wrote."""
    client = redis.Redis.from_url(stack.redis_url)
    yield client
    client.close()

