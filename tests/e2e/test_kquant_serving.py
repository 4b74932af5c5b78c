"""Opt-in: llama.cpp's own K-quant files of SmolLM2 served end to end, in their formats.

Skipped unless LLMSERVE_KQUANT_DIR names a folder with files `llama-quantize --allow-requantize` wrote
from the cached Q4_1 file (docs/models.md, "Weight formats", says how):
SmolLM2-135M-Instruct.{Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0}.gguf; the ones present are served."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest

from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

FOLDER = os.environ.get("LLMSERVE_KQUANT_DIR", "")
FILES = sorted(Path(FOLDER).glob("SmolLM2-135M-Instruct.*.gguf")) if FOLDER else []
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600),
              pytest.mark.skipif(not FILES, reason="LLMSERVE_KQUANT_DIR names no folder of requantized SmolLM2 files")]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.split(".")[-2])
def test_a_requantized_file_is_served_in_its_own_formats(start_stack, auth_metadata, path):
    stack = start_stack(workers=1, model=str(path))
    channel = grpc.insecure_channel(stack.gateway_target)
    try:
        request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
                                     sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=24))
        reply = inference_pb2_grpc.InferenceStub(channel).Complete(request, metadata=auth_metadata, timeout=120)
    finally:
        channel.close()
    # a twice-quantized 135M model need not know the answer (Q4_K_M says "L'Etoile"): it must answer
    assert reply.usage.completion_tokens > 0 and reply.text.strip()
    loaded = [json.loads(line) for log in stack.log_dir.glob("gpu_worker*.log")
              for line in log.read_text().splitlines() if '"model loaded"' in line]
    assert loaded and all(entry["weight_format"].startswith("gguf") for entry in loaded)
