"""The roofline meter (gpu_worker/roofline.py): a step's bytes are the weights in their stored format
plus the KV its queries attended over, by hand for tiny models of known shape (dense Llama in fp32,
int4 and a Q8_0 GGUF; Gemma 3 with windowed layers); the probe measures something; the worker's
metrics carry the figures after a step."""

from __future__ import annotations

import gguf
import pytest
import torch
from prometheus_client import REGISTRY
from tiny_models import BASE, GEMMA, VOCAB, make_hf_dir, write_gguf

from gpu_worker import metrics
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.loader import load_model
from gpu_worker.roofline import BandwidthProbe, KVFootprint, RooflineMeter, probe_bandwidth, weight_bytes

pytest.importorskip("transformers")

H, LAYERS, HEADS, KV_HEADS, D = 64, 2, 4, 2, 16  # tiny_models BASE with llama's head_dim
INTER = 128                                      # a multiple of 64: no padded block pair in int4
FP32, Q4_1_BLOCK, Q8_0_BLOCK = 4, 20, 34         # bytes per weight; per 32 weights
GEMM_WEIGHTS = ((HEADS + 2 * KV_HEADS) * D * H   # qkv
                + H * HEADS * D                  # o
                + 2 * INTER * H                  # gate and up
                + H * INTER)                     # down
NORMS = 2 * H * LAYERS + H                       # input and post norms of each layer, the final norm
HEAD = VOCAB * H
KV_TOKEN_LAYER = 2 * KV_HEADS * D * FP32         # K and V of one token in one layer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, cache_dir):
    assert (BASE["hidden_size"], BASE["num_hidden_layers"], BASE["num_attention_heads"],
            BASE["num_key_value_heads"]) == (H, LAYERS, HEADS, KV_HEADS)
    return make_hf_dir("llama", tmp_path_factory.mktemp("llama") / "hf", seed=1, intermediate_size=INTER)


def engine_for(model, budget: int = 64) -> LLMEngine:
    return LLMEngine.create(model, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4,
                                                max_num_batched_tokens=budget))


def run_steps(engine: LLMEngine, prompts: list[int], new_tokens: int) -> list[int]:
    """Each step's bytes, one prompt of each length in `prompts` generating `new_tokens`."""
    for n in prompts:
        engine.add(Sequence(list(range(3, 3 + n)), SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                                                  ignore_eos=True)))
    read = []
    while engine.has_work():
        engine.step()
        read.append(engine.stats().roofline.last_step_bytes)
    return read


@pytest.mark.parametrize("quantization, stored", [
    ("none", (LAYERS * GEMM_WEIGHTS + HEAD) * FP32 + NORMS * FP32),
    ("int4", LAYERS * GEMM_WEIGHTS // 32 * Q4_1_BLOCK + HEAD // 32 * Q8_0_BLOCK + NORMS * FP32),
])
def test_dense_weights_count_in_their_stored_format(llama_dir, quantization, stored):
    model = load_model(llama_dir, "cpu", torch.float32, quantization=quantization)
    assert weight_bytes(model) == stored


def test_a_q8_0_gguf_counts_the_files_own_blocks(llama_dir, tmp_path):
    path = write_gguf(llama_dir, "llama", tmp_path / "tiny-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    model = load_model(path, "cpu", torch.float32, quantization="auto")  # keeps the file's formats
    assert weight_bytes(model) == (LAYERS * GEMM_WEIGHTS + HEAD) // 32 * Q8_0_BLOCK + NORMS * FP32


def test_dense_steps_read_the_weights_and_the_kv_of_their_contexts(llama_dir):
    """Prompts of 5 and 3 tokens prefilled together, then two decode steps of both."""
    engine = engine_for(load_model(llama_dir, "cpu", torch.float32, quantization="none"))
    weights = weight_bytes(engine.model)
    kv = LAYERS * KV_TOKEN_LAYER
    steps = run_steps(engine, [5, 3], new_tokens=3)
    assert steps == [weights + (5 + 3) * kv, weights + (6 + 4) * kv, weights + (7 + 5) * kv]
    stats = engine.stats().roofline
    assert stats.total_bytes == sum(steps) and stats.last_step_s > 0 and stats.total_step_s >= stats.last_step_s
    assert stats.achieved_gbps == pytest.approx(steps[-1] / stats.last_step_s / 1e9)
    assert stats.fraction == 0.0  # no probe


def test_windowed_layers_read_at_most_their_window(tmp_path_factory, cache_dir):
    """Gemma 3's tiny variant: six layers alternating windowed (window 4) and full, one kv head of 256.
    A 9-token prompt in chunks of 6 and 3, then decodes: a windowed layer's query at p reads keys
    p-3..p, a chunk [s, e) keys max(0, s-3)..e-1."""
    model = load_model(make_hf_dir("gemma3", tmp_path_factory.mktemp("gemma3"), variant=True, seed=2), "cpu",
                       torch.float32, quantization="none")
    assert model.config.sliding_layers == (True, False) * 3 and model.config.sliding_window == GEMMA["sliding_window"] == 4
    token_layer = 2 * 1 * 256 * FP32
    engine = engine_for(model, budget=6)
    weights = weight_bytes(model)
    steps = run_steps(engine, [9], new_tokens=3)
    full, windowed = 3, 3
    assert steps == [
        weights + (full * 6 + windowed * 6) * token_layer,            # chunk [0, 6)
        weights + (full * 9 + windowed * (9 - 3)) * token_layer,      # chunk [6, 9): keys 3..8
        weights + (full * 10 + windowed * 4) * token_layer,           # decode at 9: keys 6..9
        weights + (full * 11 + windowed * 4) * token_layer,
    ]


def test_gemma3_weights_count_its_extra_norms(tmp_path_factory, cache_dir):
    model = load_model(make_hf_dir("gemma3", tmp_path_factory.mktemp("gemma3-w"), variant=True, seed=2), "cpu",
                       torch.float32, quantization="none")
    q, kv, inter, layers = 2 * 256, 1 * 256, BASE["intermediate_size"], 6
    gemms = (q + 2 * kv) * H + H * q + 2 * inter * H + H * inter
    norms = 256 + 256 + 4 * H                                         # q/k norms, input/post/sandwich norms
    assert weight_bytes(model) == (layers * (gemms + norms) + H + VOCAB * H) * FP32  # tied head, untied on CPU


def test_span_bytes_by_hand():
    kv = KVFootprint(token_layer_bytes=10, windows=((None, 2), (4, 1)))
    assert kv.span_bytes(0, 1) == (2 * 1 + 1) * 10
    assert kv.span_bytes(9, 10) == (2 * 10 + 4) * 10
    assert kv.span_bytes(2, 8) == (2 * 8 + 8) * 10                # window covers the whole chunk's reach
    assert kv.span_bytes(10, 12) == (2 * 12 + (12 - 7)) * 10      # keys 7..11


def test_the_probe_measures_a_positive_bandwidth():
    probe = probe_bandwidth("cpu", repeats=2)
    assert probe.gbps > 0 and probe.kind == "read" and probe.buffer_bytes >= 64 * 2**20 and probe.seconds > 0


def test_fraction_is_of_the_probe_and_the_worker_metrics_carry_the_step(llama_dir):
    engine = engine_for(load_model(llama_dir, "cpu", torch.float32, quantization="int4"))
    probe = engine.probe_bandwidth()
    assert probe > 0 and engine.probe_bandwidth() >= probe   # the best probe so far
    probe = engine.stats().roofline.probe_gbps
    before = REGISTRY.get_sample_value("llmserve_worker_step_bytes_total") or 0.0
    run_steps(engine, [4], new_tokens=1)
    stats = engine.stats().roofline
    metrics.observe_roofline(stats)
    assert stats.probe_gbps == probe and stats.fraction == pytest.approx(stats.achieved_gbps / probe)
    assert REGISTRY.get_sample_value("llmserve_worker_step_bytes_total") - before == stats.last_step_bytes
    assert REGISTRY.get_sample_value("llmserve_worker_achieved_bandwidth_gbps") == stats.achieved_gbps
    assert REGISTRY.get_sample_value("llmserve_worker_bandwidth_fraction") == stats.fraction
    engine.reset_stats()
    assert engine.stats().roofline.total_bytes == 0 and engine.stats().roofline.probe_gbps == probe


def test_meter_for_a_model_without_steps_reports_zeros():
    meter = RooflineMeter(weights=100, kv=KVFootprint(8, ((None, 1),)))
    assert meter.step_bytes([(0, 3), (5, 6)]) == 100 + (3 + 6) * 8
    assert meter.stats.achieved_gbps == 0.0 and meter.stats.fraction == 0.0


def test_the_meter_keeps_the_best_probe():
    """A probe that ran in a busy moment (the worker probes again when idle) never lowers the reference."""
    meter = RooflineMeter(weights=100, kv=KVFootprint(8, ((None, 1),)))
    assert [meter.offer_probe(BandwidthProbe("cpu", "read", gbps, 1, 1, 0.1)) for gbps in (5.0, 3.0, 7.0)] == [5, 5, 7]
    meter.record(700, 1e-7)
    assert meter.stats.probe_gbps == 7.0 and meter.stats.fraction == pytest.approx(1.0)
