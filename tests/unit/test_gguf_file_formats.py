"""A GGUF with a K-quant file's mix of types per tensor loads in the file's own formats (`--quantization auto`
on the CPU) and gives the logits of its dequantized fp32 model; an unsupported type is refused in one line;
the dequantizing load (what CUDA takes) reads every type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from gpu_worker.model import gguf_loader
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import GEMMS, LlamaModel
from gpu_worker.model.loader import load_model
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops.cpu import block_linear, kquant_linear
from gpu_worker.ops.cpu.backend import CpuBackend
from gpu_worker.ops.weights.gguf_weight import RowsWeight
from gpu_worker.ops.weights.quantized_linear import KQuantWeight, Q4_0Weight, Q4_1Weight, Q5_0Weight, Q8_0Weight
from gpu_worker.runner.cpu_step_layers import StepLayers
from gpu_worker.runner.model_runner import ModelRunner
from tests.unit.gguf_random import random_blocks

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(block_linear.library() is None or kquant_linear.library() is None,
                                reason="no C compiler or no AVX2/FMA/F16C for the block kernels")
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 96  # head_dim 64; every width a multiple of 256
# per layer the types llama-quantize's mixes put side by side (Q4_K_M keeps some V in Q6_K, a width that is
# not a multiple of 256 in Q5_0 / Q8_0), and every other supported type once
MIX = [{"attn_q": T.Q4_K, "attn_k": T.Q3_K, "attn_v": T.Q6_K, "attn_output": T.Q5_K, "ffn_gate": T.Q2_K,
        "ffn_up": T.Q2_K, "ffn_down": T.Q5_0},
       {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_gate": T.Q5_1,
        "ffn_up": T.Q4_1, "ffn_down": T.BF16}]
Q4_1_FILE = [{name: T.Q4_1 for name in MIX[0]}] * 2
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
# fp16 scales that keep each type's weights within about +-0.1
FIELD_SCALE = {T.Q4_0: 0.015, T.Q4_1: 0.007, T.Q5_0: 0.007, T.Q5_1: 0.003, T.Q8_0: 0.001, T.Q2_K: 0.004,
               T.Q3_K: 0.0008, T.Q4_K: 1e-4, T.Q5_K: 5e-5, T.Q6_K: 3e-5}


def _tensor(writer: gguf.GGUFWriter, name: str, ggml_type, shape: tuple[int, int], rng) -> None:
    if ggml_type in FIELD_SCALE:
        writer.add_tensor(name, random_blocks(ggml_type, *shape, rng, scale=FIELD_SCALE[ggml_type]), raw_dtype=ggml_type)
    elif ggml_type == T.F16:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float16))
    elif ggml_type == T.BF16:
        writer.add_tensor(name, quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), T.BF16),
                          raw_dtype=T.BF16)
    else:  # a type this does not serve: random bytes
        block, size = gguf.GGML_QUANT_SIZES[ggml_type]
        writer.add_tensor(name, rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8),
                          raw_dtype=ggml_type)


def write_gguf(path: Path, mix: list[dict], embed, head=None) -> Path:
    """A 2-layer llama GGUF of random blocks in the types `mix` names per layer; untied where `head` is a type."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(len(mix))
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    _tensor(writer, "token_embd.weight", embed, (VOCAB, HIDDEN), rng)
    if head is not None:
        _tensor(writer, "output.weight", head, (VOCAB, HIDDEN), rng)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for i, layer in enumerate(mix):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for name, ggml_type in layer.items():
            _tensor(writer, f"blk.{i}.{name}.weight", ggml_type, SHAPES[name], rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor through gguf's numpy dequantization in fp32, llama.cpp's Q/K row permutation undone
    on the floats, by HF name."""
    weights = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight") or t.name.endswith("attn_k.weight"):
            w = gguf_loader.unpermute_qk(w, HEADS if "attn_q" in t.name else KV_HEADS)
        weights[gguf_loader.hf_name(t.name, "llama")] = torch.from_numpy(np.array(w, dtype=np.float32))
    return weights


def dequantized_model(path: Path) -> LlamaModel:
    """The reference: dequantized_weights on the prepacked fp32 path."""
    config = gguf_loader.read_config(gguf.GGUFReader(str(path)))
    weights = dequantized_weights(path)
    model = LlamaModel(config, "cpu", torch.float32)
    model.load_weights(weights.items())
    assert CpuBackend().prepare_weights(model, "none")
    return model


def _meta(positions: list[int], decode: bool) -> AttentionMetadata:
    n, blocks = len(positions), torch.arange(4, dtype=torch.int32)[None]
    none = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(positions), num_prefills=0 if decode else 1, num_prefill_tokens=0 if decode else n,
        prefill_query_start_loc=torch.tensor([0] if decode else [0, n], dtype=torch.int32),
        prefill_context_lens=none if decode else torch.tensor([n], dtype=torch.int32),
        prefill_block_tables=blocks[:0] if decode else blocks,
        decode_context_lens=torch.tensor([positions[-1] + 1], dtype=torch.int32) if decode else none,
        decode_block_tables=blocks if decode else blocks[:0],
        logits_indices=torch.tensor([n - 1]) if decode else torch.arange(n),
    )


def steps(model: LlamaModel, in_c: bool = True) -> torch.Tensor:
    """Logits of a 10-token prefill (every position) and two decode steps through the model runner (the
    one-call C step where it takes the model, unless not in_c): [12, V]."""
    runner = ModelRunner(model, KVCache.allocate(model.config, 4, 16, torch.float32, "cpu"))
    if not in_c:
        runner.step_layers = None
    ids = [3, 17, 5, 90, 44, 2, 61, 8, 8, 30, 71, 12]
    out = [runner.forward(torch.tensor(ids[:10]), torch.arange(10), _meta(list(range(10)), False))]
    for p in (10, 11):
        out.append(runner.forward(torch.tensor([ids[p]]), torch.tensor([p]), _meta([p], True)))
    return torch.cat(out)


def assert_close_logits(model: LlamaModel, ref: LlamaModel) -> None:
    """The kernels' 8-bit input codes (half a step of a block's largest input / 127; Q8_0's are 16-bit
    without VNNI) over 2 layers and the head put a position's logits about 1e-2 from fp32's, relative (the
    Q4_K_M layout: 0.009 to 0.013), and the random 2-layer models amplify it at some positions (the K-quant
    mix: 0.065 at one of its 12). A wrong weight row, scale or part order puts the typical position off by ~1."""
    got, want = steps(model), steps(ref)
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert rel.median() < 3e-2 and rel.max() < 0.15, rel


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_k_quant_mix_keeps_its_formats_and_gives_the_dequantized_logits(tmp_path):
    path = write_gguf(tmp_path / "mix.gguf", MIX, embed=T.Q6_K, head=T.F16)
    model = load_model(path, "cpu", torch.float32, quantization="auto")
    first, second = model.layers
    assert isinstance(first.qkv_weight, RowsWeight)  # Q4_K, Q3_K and Q6_K rows
    assert type(first.o_weight) is KQuantWeight and type(first.gate_up_weight) is KQuantWeight
    assert type(first.down_weight) is Q5_0Weight
    assert [type(p) for p in second.qkv_weight.parts] == [Q5_0Weight, Q8_0Weight]  # Q5_0 Q and K, a Q8_0 V
    assert type(second.o_weight) is Q4_0Weight
    assert isinstance(second.gate_up_weight, RowsWeight)  # Q5_1 gate beside a Q4_1 up
    assert second.down_weight.is_mkldnn and model.lm_head.is_mkldnn  # BF16 and F16: prepacked fp32
    assert StepLayers.build(model) is None  # BF16 and F16 parts on no C kernel: the Python path runs
    assert not (tmp_path / "cache" / "converted").exists()  # no dequantized copy of the file
    assert_close_logits(model, dequantized_model(path))


def test_a_q4_1_file_still_runs_all_layers_in_one_c_call(tmp_path):
    path = write_gguf(tmp_path / "q41.gguf", Q4_1_FILE, embed=T.Q8_0)
    model = load_model(path, "cpu", torch.float32, quantization="auto")
    assert type(model.layers[0].qkv_weight) is Q4_1Weight and type(model.lm_head) is Q8_0Weight  # tied head
    assert StepLayers.build(model) is not None
    assert_close_logits(model, dequantized_model(path))


LEGACY_Q4_K_M = {name: T.Q5_0 for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
# llama-quantize's Q4_K_M of a model whose width is no multiple of 256 (SmolLM2): Q5_0 Q, K, O, gate and up,
# V in Q8_0 or Q5_0, down in Q4_K or Q6_K
Q4_K_M_LAYOUT = [LEGACY_Q4_K_M | {"attn_v": T.Q8_0, "ffn_down": T.Q6_K},
                 LEGACY_Q4_K_M | {"attn_v": T.Q5_0, "ffn_down": T.Q4_K}]
QKV_NAMES = ("attn_q", "attn_k", "attn_v")
# every other kernel kind once, fused parts of one type
EVERY_KIND = [dict.fromkeys(QKV_NAMES, T.Q2_K) | {"attn_output": T.Q3_K, "ffn_gate": T.Q5_K, "ffn_up": T.Q5_K,
                                                   "ffn_down": T.Q5_1},
              dict.fromkeys(QKV_NAMES, T.Q4_1) | {"attn_output": T.Q4_0, "ffn_gate": T.Q6_K, "ffn_up": T.Q6_K,
                                                   "ffn_down": T.Q8_0}]


@pytest.mark.parametrize("mix", [Q4_K_M_LAYOUT, EVERY_KIND], ids=["Q4_K_M layout", "every kernel kind"])
def test_c_kernel_layers_run_in_one_c_call_with_the_python_paths_bits(tmp_path, mix):
    """Every weight on a C kernel, in any mix across weights and within a fused one (the Q4_K_M layout's
    Q5_0 Q and K beside a Q8_0 V): the step runs in one call, with the per-layer path's logits bit for bit."""
    path = write_gguf(tmp_path / "mix.gguf", mix, embed=T.Q8_0)
    model = load_model(path, "cpu", torch.float32, quantization="auto")
    fused = [getattr(layer, name) for layer in model.layers for name in GEMMS]
    assert sum(isinstance(w, RowsWeight) for w in fused) == (1 if mix is Q4_K_M_LAYOUT else 0)
    assert StepLayers.build(model) is not None
    assert torch.equal(steps(model), steps(model, in_c=False))
    assert_close_logits(model, dequantized_model(path))


def test_the_dequantizing_load_reads_every_type(tmp_path):
    """CUDA (and an explicit --quantization none/int8/int4) load through the dequantized cache: a K-quant mix
    arrives in the model's dtype, gguf's values up to the cache's fp16 and the bf16 rounding."""
    path = write_gguf(tmp_path / "mix.gguf", MIX, embed=T.Q6_K, head=T.F16)
    model = load_model(path, "cpu", torch.bfloat16, prepack=False)
    want = dequantized_weights(path)
    qkv = torch.cat([want[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert model.layers[0].qkv_weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.layers[0].qkv_weight.float(), qkv, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(model.embed.float(), want["model.embed_tokens.weight"], rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_an_unsupported_type_is_refused_in_one_line(tmp_path, quantization):
    mix = [MIX[0] | {"attn_k": T.IQ4_NL}, MIX[1]]
    path = write_gguf(tmp_path / "iq.gguf", mix, embed=T.Q8_0)
    with pytest.raises(ValueError) as refused:
        load_model(path, "cpu", torch.float32, quantization=quantization)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (f"{path}: tensor blk.0.attn_k.weight has GGUF type IQ4_NL, which is not supported "
                       "(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")
