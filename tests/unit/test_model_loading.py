"""Tiny random Llama checkpoints written as HF safetensors dirs and as GGUF files: the loaders and
the paged, batched forward must reproduce a dense float64 reference implementation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from gpu_worker.model import gguf_loader
from gpu_worker.model.config import RopeScaling
from gpu_worker.model.hf_loader import load_config
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.loader import load_model
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.model.rope import inv_freq
from gpu_worker.ops.cpu import block_linear as cpu_block_linear
from gpu_worker.ops.weights import quantized_linear

Q8 = gguf.GGMLQuantizationType.Q8_0
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))


# ---- checkpoint factories -------------------------------------------------------------------------


def make_weights(cfg: dict, *, tied: bool, bias: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rnd(*shape, std=0.3):
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": rnd(v, h, std=1.0), "model.norm.weight": 1 + rnd(h, std=0.1)}
    if not tied:
        w["lm_head.weight"] = rnd(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w |= {p + "input_layernorm.weight": 1 + rnd(h, std=0.1), p + "post_attention_layernorm.weight": 1 + rnd(h, std=0.1),
              p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
              p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
              p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h), p + "mlp.down_proj.weight": rnd(h, i)}
        if bias:
            w |= {p + "self_attn.q_proj.bias": rnd(q), p + "self_attn.k_proj.bias": rnd(kv),
                  p + "self_attn.v_proj.bias": rnd(kv)}
    return w


def write_hf_dir(path: Path, cfg: dict, weights: dict[str, torch.Tensor], shards: int = 1) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"))
        return path
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / fname))
        weight_map |= {n: fname for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K weights (interleaved-pair RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, n, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{n}.{_TO_GGUF[module]}.{kind}"


STORAGE = {"attn": gguf.GGMLQuantizationType.F16, "ffn_gate": gguf.GGMLQuantizationType.Q4_0,
           "ffn_up": gguf.GGMLQuantizationType.Q4_1}


def qtype_for(name: str) -> gguf.GGMLQuantizationType:
    """A mix of storage types: 1-D tensors F32, attention F16, gate Q4_0, up Q4_1, the rest Q8_0."""
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return gguf.GGMLQuantizationType.F32
    return next((t for key, t in STORAGE.items() if key in name), Q8)


def write_gguf(path: Path, cfg: dict, weights: dict[str, torch.Tensor], arch: str = "llama") -> dict[str, torch.Tensor]:
    """Write a GGUF (Q/K permuted as llama.cpp does for arch llama only); returns the weights as they
    round-trip through their storage types, in HF layout."""
    permute = arch == "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    stored = {}
    for hf, tensor in weights.items():
        name = gguf_name(hf)
        arr = tensor.numpy().astype(np.float32)
        if permute and name.endswith("attn_q.weight"):
            arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif permute and name.endswith("attn_k.weight"):
            arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
        kind = qtype_for(name)
        if kind in (Q8, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
            data = quantize(arr, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
            back = dequantize(data, kind)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, arr.astype(np.float16))
            back = arr.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(name, arr)
            back = arr
        stored[hf] = torch.from_numpy(np.array(back)).view(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # undo the permutation in the returned copy: HF layout, for an HF dir with the same values
    for hf in stored:
        if permute and ("q_proj.weight" in hf or "k_proj.weight" in hf):
            heads = cfg["num_attention_heads"] if "q_proj" in hf else cfg["num_key_value_heads"]
            d = stored[hf].shape[0] // heads
            stored[hf] = stored[hf].view(heads, d // 2, 2, -1).transpose(1, 2).reshape(stored[hf].shape)
    return stored


# ---- dense float64 reference (Hugging Face semantics) ---------------------------------------------


def dense_logits(w: dict[str, torch.Tensor], cfg: dict, ids: list[int], inv: torch.Tensor) -> torch.Tensor:
    """[T, vocab] float64 logits of a full causal forward over `ids`."""
    w = {k: v.double() for k, v in w.items()}
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    t = len(ids)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv.double())
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]

    def rms(x, g):
        return x / (x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]).sqrt() * g

    def rope(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def lin(x, name):
        return x @ w[name + ".weight"].T + w.get(name + ".bias", 0)

    x = w["model.embed_tokens.weight"][ids]
    causal = torch.ones(t, t).tril().bool()
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope(lin(h, p + "self_attn.q_proj").view(t, nh, d))
        k = rope(lin(h, p + "self_attn.k_proj").view(t, nkv, d)).repeat_interleave(nh // nkv, 1)
        v = lin(h, p + "self_attn.v_proj").view(t, nkv, d).repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        a = torch.einsum("hqk,khd->qhd", s.masked_fill(~causal, float("-inf")).softmax(-1), v)
        x = x + lin(a.reshape(t, nh * d), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + lin(torch.nn.functional.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"]) @ head.T


# ---- paged stepping ----------------------------------------------------------------------------------

BLOCK = 4
TABLES = {"a": [5, 2, 9, 11, 3], "b": [7, 1, 12, 8, 4, 6], "c": [10, 13, 14]}  # non-contiguous


def step_meta(chunks: list[tuple[str, int, int, bool]]) -> tuple[list[int], list[int], AttentionMetadata]:
    """chunks: (seq, first position, count, is_decode), prefills first. Returns slots, positions, metadata."""
    i32 = torch.int32
    slots, positions, logits_idx = [], [], []
    width = max(len(t) for t in TABLES.values())

    def table(seq):
        return TABLES[seq] + [0] * (width - len(TABLES[seq]))

    prefills = [c for c in chunks if not c[3]]
    decodes = [c for c in chunks if c[3]]
    starts = [0]
    for seq, first, count, _ in prefills + decodes:
        pos = list(range(first, first + count))
        positions += pos
        slots += [TABLES[seq][p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        logits_idx.append(len(positions) - 1)
    for _, _, count, _ in prefills:
        starts.append(starts[-1] + count)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_prefills=len(prefills),
        num_prefill_tokens=starts[-1],
        prefill_query_start_loc=torch.tensor(starts, dtype=i32),
        prefill_context_lens=torch.tensor([f + c for _, f, c, _ in prefills], dtype=i32),
        prefill_block_tables=torch.tensor([table(s) for s, *_ in prefills], dtype=i32).view(-1, width),
        decode_context_lens=torch.tensor([f + c for _, f, c, _ in decodes], dtype=i32),
        decode_block_tables=torch.tensor([table(s) for s, *_ in decodes], dtype=i32).view(-1, width),
        logits_indices=torch.tensor(logits_idx, dtype=torch.int64),
    )
    return slots, positions, meta


def run_step(model, cache, seqs: dict[str, list[int]], chunks) -> torch.Tensor:
    _, positions, meta = step_meta(chunks)
    ids = [seqs[s][p] for s, f, c, _ in [c for c in chunks if not c[3]] + [c for c in chunks if c[3]]
           for p in range(f, f + c)]
    return model(torch.tensor(ids), torch.tensor(positions), meta, cache)


SEQS = {"a": [3, 17, 5, 90, 44, 2, 61, 8, 8, 30, 71, 12], "b": list(range(10, 30)), "c": [50, 51, 52, 9, 1]}


def check_batched_steps(model, weights, cfg, inv, tol=2e-4):
    """Three engine-like steps mixing full prefills, chunked prefill over a cached prefix, and decodes."""
    cache = KVCache.allocate(model.config, 16, BLOCK, torch.float32, "cpu")
    dense = {s: dense_logits(weights, cfg, ids, inv) for s, ids in SEQS.items()}
    steps = [
        [("a", 0, 10, False), ("b", 0, 7, False)],  # a: whole prompt; b: first chunk
        [("b", 7, 12, False), ("c", 0, 5, False), ("a", 10, 1, True)],  # b: chunk over cached prefix
        [("b", 19, 1, True), ("a", 11, 1, True)],  # decodes only
    ]
    for chunks in steps:
        logits = run_step(model, cache, SEQS, chunks)
        order = [c for c in chunks if not c[3]] + [c for c in chunks if c[3]]
        assert logits.shape == (len(order), cfg["vocab_size"]) and logits.dtype == torch.float32
        for row, (seq, first, count, _) in enumerate(order):
            expect = dense[seq][first + count - 1]
            torch.testing.assert_close(logits[row].double(), expect, rtol=tol, atol=tol * expect.abs().max().item())


# ---- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_hf_dir_batched_forward_matches_dense(tmp_path, tied):
    cfg = TINY | {"model_type": "llama", "tie_word_embeddings": tied}
    weights = make_weights(cfg, tied=tied, bias=False)
    model = load_model(write_hf_dir(tmp_path / "m", cfg, weights), "cpu", torch.float32)
    assert model.config.tie_word_embeddings is tied
    check_batched_steps(model, weights, cfg, inv_freq(model.config))


def test_sharded_safetensors_loads_like_single(tmp_path):
    cfg = TINY | {"model_type": "llama"}
    weights = make_weights(cfg, tied=False, bias=False, seed=4)
    model = load_model(write_hf_dir(tmp_path / "sharded", cfg, weights, shards=3), "cpu", torch.float32)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    check_batched_steps(model, weights, cfg, inv_freq(model.config))


def test_qwen2_qkv_bias(tmp_path):
    cfg = TINY | {"model_type": "qwen2", "tie_word_embeddings": True}
    weights = make_weights(cfg, tied=True, bias=True, seed=2)
    model = load_model(write_hf_dir(tmp_path / "q", cfg, weights), "cpu", torch.float32)
    assert model.config.attention_bias
    check_batched_steps(model, weights, cfg, inv_freq(model.config))
    del weights["model.layers.1.self_attn.k_proj.bias"]  # a bias model missing a bias must not load
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_model(write_hf_dir(tmp_path / "q2", cfg, weights), "cpu", torch.float32)


def test_gguf_f32_f16_q8_0_q4_matches_hf_dir(tmp_path):
    cfg = TINY | {"model_type": "llama", "tie_word_embeddings": False}
    weights = make_weights(cfg, tied=False, bias=False, seed=3)
    stored = write_gguf(tmp_path / "tiny.gguf", cfg, weights)
    types = {t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "tiny.gguf")).tensors}
    assert types == {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, Q8,
                     gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1}

    from_gguf = load_model(tmp_path / "tiny.gguf", "cpu", torch.float32)
    c = from_gguf.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (2, 4, 2, 8, 96)
    assert (c.tie_word_embeddings, c.rope_interleaved, c.bos_token_id, c.eos_token_ids) == (False, False, 1, (2,))
    # fp16 rounding of dequantized Q8_0 values in the cache: slightly looser than pure fp32
    check_batched_steps(from_gguf, stored, cfg, inv_freq(c), tol=2e-3)

    hf_model = load_model(write_hf_dir(tmp_path / "hf", cfg, stored), "cpu", torch.float32)
    ids = torch.tensor(SEQS["b"])
    _, positions, meta = step_meta([("b", 0, len(ids), False)])
    for_meta = [KVCache.allocate(c, 16, BLOCK, torch.float32, "cpu") for _ in range(2)]
    a = from_gguf(ids, torch.tensor(positions), meta, for_meta[0])
    b = hf_model(ids, torch.tensor(positions), meta, for_meta[1])
    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3 * b.abs().max().item())


def test_qwen2_gguf_with_bias_is_not_unpermuted(tmp_path):
    cfg = TINY | {"model_type": "qwen2", "tie_word_embeddings": True}
    stored = write_gguf(tmp_path / "qwen.gguf", cfg, make_weights(cfg, tied=True, bias=True, seed=7), arch="qwen2")
    model = load_model(tmp_path / "qwen.gguf", "cpu", torch.float32)
    c = model.config
    assert (c.architecture, c.attention_bias, c.tie_word_embeddings, c.rope_interleaved) == ("qwen2", True, True, False)
    check_batched_steps(model, stored, cfg, inv_freq(c), tol=2e-3)


def test_gguf_interleaved_layout_matches_unpermuted(tmp_path):
    """Keeping GGUF's permuted Q/K with interleaved RoPE == un-permuting to HF layout."""
    cfg = TINY | {"model_type": "llama", "tie_word_embeddings": True}
    stored = write_gguf(tmp_path / "t.gguf", cfg, make_weights(cfg, tied=True, bias=False, seed=5))
    config, weights = gguf_loader.load(tmp_path / "t.gguf", unpermute=False)
    assert config.rope_interleaved
    model = LlamaModel(config, "cpu", torch.float32)
    model.load_weights(weights)
    check_batched_steps(model, stored, cfg, inv_freq(config), tol=2e-3)


def test_gguf_conversion_is_cached(tmp_path):
    cfg = TINY | {"model_type": "llama", "tie_word_embeddings": True}
    write_gguf(tmp_path / "c.gguf", cfg, make_weights(cfg, tied=True, bias=False))
    target = gguf_loader.cache_path(tmp_path / "c.gguf")
    assert not target.exists()
    first = load_model(tmp_path / "c.gguf", "cpu", torch.float32, prepack=False)
    assert target.exists() and target.parent.parent == tmp_path / "cache"
    mtime = target.stat().st_mtime_ns
    second = load_model(tmp_path / "c.gguf", "cpu", torch.float32, prepack=False)
    assert target.stat().st_mtime_ns == mtime  # reused, not rewritten
    assert second.config == first.config
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters()))


def test_mistral_sliding_window_on_every_layer_and_eos_from_generation_config(tmp_path):
    cfg = TINY | {"model_type": "mistral", "sliding_window": 64, "head_dim": 8}
    weights = make_weights(cfg, tied=False, bias=False, seed=6)
    path = write_hf_dir(tmp_path / "mistral", cfg, weights)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    model = load_model(path, "cpu", torch.float32)
    assert (model.config.context_length, model.config.eos_token_ids, model.config.architecture) == (128, (2, 7), "mistral")
    assert [model.config.layer_window(i) for i in range(2)] == [64, 64]  # the window, not a capped context
    check_batched_steps(model, weights, cfg, inv_freq(model.config))


def test_unsupported_architecture_is_refused(tmp_path):
    cfg = TINY | {"model_type": "gpt2"}
    path = write_hf_dir(tmp_path / "gpt2", cfg, make_weights(cfg, tied=True, bias=False))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(path, "cpu", torch.float32)


def test_llama3_rope_scaling_config(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = TINY | {"model_type": "llama", "rope_scaling": scaling, "rope_theta": 500000.0}
    weights = make_weights(cfg, tied=False, bias=False)
    config = load_config(write_hf_dir(tmp_path / "l3", cfg, weights))
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    plain = 1.0 / 500000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    scaled = inv_freq(config)
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 64 / 4], plain[wavelen < 64 / 4])  # high frequencies kept
    torch.testing.assert_close(scaled[wavelen > 64], plain[wavelen > 64] / 8)  # low frequencies / factor
    model = load_model(tmp_path / "l3", "cpu", torch.float32)
    check_batched_steps(model, weights, cfg, scaled)


def test_gpus_without_native_bf16_default_to_fp16(monkeypatch):
    """torch reports bf16 as supported on pre-sm_80 GPUs by emulating it; those get fp16."""
    import torch

    from gpu_worker.model.loader import default_dtype

    native = {"sm_75": False, "sm_80": True}
    for arch, has_native_bf16 in native.items():
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, n=has_native_bf16: n or including_emulation)
        assert default_dtype("cuda") == (torch.bfloat16 if has_native_bf16 else torch.float16), arch
    assert default_dtype("cpu") == torch.float32


def test_auto_quantization_is_int4_on_the_cpu_where_every_gemm_width_allows(tmp_path):
    cfg = TINY | {"model_type": "llama"}  # hidden 32, heads 4 x 8, intermediate 64: all multiples of 32
    model = load_model(write_hf_dir(tmp_path / "m", cfg, make_weights(cfg, tied=False, bias=False)), "cpu",
                       torch.float32, quantization="auto")
    if cpu_block_linear.library() is None:
        assert model.layers[0].qkv_weight.is_mkldnn  # no block kernel here: auto means fp32
    else:
        assert isinstance(model.layers[0].qkv_weight, quantized_linear.Q4_1Weight)
    odd = TINY | {"model_type": "llama", "intermediate_size": 48}  # the down projection's width is not
    model = load_model(write_hf_dir(tmp_path / "odd", odd, make_weights(odd, tied=False, bias=False)), "cpu",
                       torch.float32, quantization="auto")
    assert model.layers[0].down_weight.is_mkldnn
