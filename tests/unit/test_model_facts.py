"""What ListModels says a concrete model is: the weight format load_model serves (model/weight_format.py),
published by the worker's heartbeat and kept by the gateway's router from a real Valkey."""

from __future__ import annotations

import asyncio

import gguf
import pytest
import redis.asyncio as aioredis
import torch
from tiny_models import make_hf_dir, write_gguf

from gateway.model_router import ModelFacts, Router
from gpu_worker.engine.engine import EngineStats
from gpu_worker.heartbeat import Heartbeat
from gpu_worker.model.loader import load_model
from gpu_worker.ops.cpu import block_linear, kquant_linear
from llmserve.catalog.models_file import from_setting

MODEL = "tiny@v1"
kernels = pytest.mark.skipif(block_linear.library() is None or kquant_linear.library() is None,
                             reason="the C kernels do not build here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("facts")
    hf_dir = make_hf_dir("llama", root / "hf")
    return hf_dir, write_gguf(hf_dir, "llama", root / "tiny-q8_0.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)


@kernels
def test_a_quantized_gguf_kept_in_its_blocks_is_named_by_its_file_type(tiny):
    _, path = tiny
    assert load_model(path, "cpu", torch.float32, quantization="auto").weight_format == "gguf:Q8_0"


@pytest.mark.parametrize("quantization, dtype, expected", [
    ("none", torch.float32, "f32"), ("none", torch.bfloat16, "bf16"), ("int8", torch.float32, "int8"),
])
def test_dense_and_requantized_weights_are_named_by_what_the_gemms_run_on(tiny, quantization, dtype, expected):
    hf_dir, path = tiny
    assert load_model(hf_dir, "cpu", dtype, quantization=quantization).weight_format == expected
    assert load_model(path, "cpu", dtype, quantization=quantization).weight_format == expected  # dequantized


def stats() -> EngineStats:
    return EngineStats(running=0, waiting=0, free_blocks=8, total_blocks=8, kv_usage=0.0, steps=0,
                       generated_tokens=0, last_batch_tokens=0, preemptions=0, prefix_hit_rate=0.0)


def test_the_router_keeps_what_the_workers_heartbeat_said(clean_redis, redis_url):
    async def scenario() -> tuple[ModelFacts | None, ModelFacts | None, ModelFacts | None, int]:
        redis = aioredis.from_url(redis_url)
        router = Router(from_setting(f"{MODEL}=/models/tiny.gguf"), redis, refresh_s=60, heartbeat_ttl_ms=3000)
        await router.refresh()
        before = router.facts_of(MODEL)
        beat = Heartbeat(redis, MODEL, "w0", "127.0.0.1:1", 0.2, 16, 4, snapshot=stats, draining=lambda: False,
                         architecture="gemma3", weight_format="gguf:Q4_K_M")
        await beat.beat()
        await router.refresh()
        live, during = router.live[MODEL], router.facts_of(MODEL)
        await beat.remove()
        await router.refresh()
        after = router.facts_of(MODEL)
        await redis.aclose()
        return before, during, after, live

    before, during, after, live = asyncio.run(scenario())
    assert before is None and live == 1
    assert during == after == ModelFacts("gemma3", "gguf:Q4_K_M")  # kept once the worker is gone
