"""ListModels and `GET /v1/models` on the shared stack name the architecture and weight format its
worker serves: SmolLM2 is a llama, its Q4_1 GGUF kept in the file's blocks on the CPU."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
from test_gateway_e2e import wait_until

from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

pytestmark = pytest.mark.e2e
KEY = "dev-key"
FACTS = ("llama", "gguf:Q4_1")


def list_models(stack) -> list[pb.ModelInfo]:
    with grpc.insecure_channel(stack.gateway_target) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).ListModels(
            pb.ListModelsRequest(), metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
    return [m for m in reply.models if m.kind == pb.MODEL_KIND_CONCRETE]


def test_list_models_names_the_architecture_and_weight_format(stack):
    # the gateway learns them from the worker's heartbeats, re-read every few hundred ms
    assert wait_until(lambda: all(m.architecture for m in list_models(stack)), timeout_s=30)
    assert [(m.architecture, m.weight_format) for m in list_models(stack)] == [FACTS]


def test_v1_models_carries_them_as_extra_keys(stack):
    assert wait_until(lambda: all(m.architecture for m in list_models(stack)), timeout_s=30)
    request = urllib.request.Request(f"{stack.http_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        data = json.load(reply)["data"]
    concrete = [m for m in data if "architecture" in m]
    assert [(m["architecture"], m["weight_format"]) for m in concrete] == [FACTS]
    assert all(m["context_length"] > 0 for m in concrete)
