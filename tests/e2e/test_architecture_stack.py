"""A non-Llama architecture through the whole stack: a tiny random Gemma 3 GGUF (5 of 6 layers windowed,
q/k norms, GeGLU) with its SentencePiece tokenizer and chat template in the file, served by
`llmserve`'s own processes: chat completions end on <end_of_turn> or the length limit, a choice-
constrained answer is one of the choices, and ListModels reports the file's context length, its
architecture and the weight format served."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest
from test_gateway_e2e import wait_until

from llmserve.client import Client
from llmserve.local.stack import Stack, StackConfig
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tiny_models import BASE, GEMMA_TOKENS, make_hf_dir, write_gguf  # noqa: E402

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")
TENANTS = Path(__file__).resolve().parents[1] / "data" / "tenants.test.yaml"


@pytest.fixture(scope="module")
def gemma3_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-gemma3")
    hf_dir = make_hf_dir("gemma3", root / "hf", vocab_size=len(GEMMA_TOKENS), bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    path = write_gguf(hf_dir, "gemma3", root / "tiny-gemma3.gguf", tokenizer=True)
    stack = Stack(StackConfig(model=str(path), workers=1, device="cpu", port=0, http_port=-1, tenants=TENANTS,
                              log_dir=root / "stack")).start()
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(gemma3_stack):
    client = Client(gemma3_stack.gateway_target, api_key="dev-key")
    yield client
    client.close()


def test_chat_completions_and_a_constrained_choice(client):
    for seed in range(3):
        reply = client.complete(messages=[{"role": "user", "content": "hello world"}], max_new_tokens=12,
                                temperature=0.9, seed=seed, timeout=120)
        assert reply.finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 12
        assert reply.usage.prompt_tokens > 5  # <bos><start_of_turn>user ... <start_of_turn>model
    choices = ["yes", "no", "hello world"]
    reply = client.complete(messages=[{"role": "user", "content": "yes or no?"}], max_new_tokens=12, temperature=0.0,
                            response_format=pb.ResponseFormat(choice=pb.ChoiceList(choices=choices)), timeout=120)
    assert reply.text in choices and reply.finish_reason == "stop"


def concrete_models(stack) -> list[pb.ModelInfo]:
    with grpc.insecure_channel(stack.gateway_target) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).ListModels(
            pb.ListModelsRequest(), metadata=(("authorization", "Bearer dev-key"),), timeout=30)
    return [m for m in reply.models if m.kind == pb.MODEL_KIND_CONCRETE]


def test_list_models_reports_the_context_length_architecture_and_weight_format(gemma3_stack):
    # the float file's GEMMs run as int4 (--quantization auto); the facts come with the worker's heartbeats
    assert wait_until(lambda: all(m.architecture for m in concrete_models(gemma3_stack)), timeout_s=30)
    assert [(m.context_length, m.architecture, m.weight_format) for m in concrete_models(gemma3_stack)] == \
        [(BASE["max_position_embeddings"], "gemma3", "int4")]
