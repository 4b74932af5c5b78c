"""Tiny random-weight checkpoints of every supported architecture, built by transformers' own model
classes, and the same weights written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes them.

    hf_dir = make_hf_dir("gemma2", tmp / "gemma2")        # config.json + model.safetensors (+ tokenizer)
    gguf = write_gguf(hf_dir, tmp / "gemma2.gguf", Q8_0)  # same weights: llama.cpp names, layout, metadata

Sizes are small but the layer structure is real. Where transformers reads a GGUF without a key the file
cannot carry (Gemma's query_pre_attn_scalar, its soft-caps; Qwen3's head_dim), the tiny config keeps
transformers' default, so both readers of the GGUF agree; the safetensors configs vary them instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import quantize
from safetensors.torch import load_file

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, tie_word_embeddings=False)
GEMMA = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=4,
             tie_word_embeddings=True)

# name -> (transformers config class, what differs from BASE); "safetensors_only" differences are ones
# a GGUF cannot carry to transformers' GGUF reader
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(head_dim=16, rope_theta=10000.0)),
    "llama3": ("LlamaConfig", dict(head_dim=16, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=4)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)),
    "gemma2": ("Gemma2Config", GEMMA | dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", GEMMA | dict(num_hidden_layers=6, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("Phi3Config", {}),
}
# safetensors-only variants: values no GGUF key carries to transformers
SAFETENSORS_VARIANTS = {
    "gemma2": dict(attn_logit_softcapping=3.0, final_logit_softcapping=2.0, query_pre_attn_scalar=64),
    "gemma3": dict(query_pre_attn_scalar=64, layer_types=["sliding_attention", "full_attention"] * 3),
}
GGUF_ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}


def hf_config(arch: str, variant: bool = False, **overrides):
    import transformers

    cls, extra = ARCHS[arch]
    variant_fields = SAFETENSORS_VARIANTS.get(arch, {}) if variant else {}
    return getattr(transformers, cls)(**(BASE | extra | variant_fields | overrides))


@torch.no_grad()
def make_hf_dir(arch: str, path: Path, variant: bool = False, seed: int = 0, **overrides) -> Path:
    """A random-weight checkpoint of `arch` saved by transformers (safetensors, fp32). Every weight is
    drawn at a scale where the architecture's mechanisms (norm weights, soft-caps, windows) move the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, variant, **overrides), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    norm_center = 0.0 if arch.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(norm_center + 0.1 * noise)
        else:
            p.copy_(noise * (1.0 if "embed" in name else 0.15))
    model.save_pretrained(path)
    return path


# ---- GGUF, as llama.cpp's convert_hf_to_gguf.py writes it ---------------------------------------------

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensor_name(hf: str, arch: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, n, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = _LAYER | (_GEMMA_LAYER if arch.startswith("gemma") else {})
    return f"blk.{n}.{names[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate_half rows -> interleaved-pair rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_tensor(hf: str, w: np.ndarray, arch: str, cfg: dict) -> np.ndarray:
    """What the converter does to one tensor's values: permute llama Q/K, store Gemma norms as 1 + w."""
    if GGUF_ARCH[arch] == "llama" and "q_proj.weight" in hf:
        return llama_cpp_permute(w, cfg["num_attention_heads"])
    if GGUF_ARCH[arch] == "llama" and "k_proj.weight" in hf:
        return llama_cpp_permute(w, cfg["num_key_value_heads"])
    if arch.startswith("gemma") and hf.endswith("norm.weight"):
        return w + 1
    return w


def _write_metadata(writer: gguf.GGUFWriter, cfg: dict, arch: str, file_type: int) -> None:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    writer.add_name(f"tiny-{arch}")
    writer.add_file_type(file_type)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    if cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3.1 RoPE scaling as the
    per-frequency divisors of tensor `rope_freqs` [head_dim / 2]."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


# A Gemma-style SentencePiece vocabulary (byte fallback, no space prefix) and chat template, for a GGUF
# that a whole stack serves: make_hf_dir(..., vocab_size=len(GEMMA_TOKENS), bos_token_id=1, eos_token_id=2)
GEMMA_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                *(f"<0x{b:02X}>" for b in range(256)),
                "▁", "e", "l", "o", "h", "w", "r", "d", "t", "a", "n", "he", "ll", "llo", "hello", "▁hello", "▁w",
                "or", "▁wor", "ld", "▁world", "▁t", "▁th", "▁the", "an", "▁an", "▁and", "es", "▁yes", "▁no"]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def write_gemma_tokenizer(writer: gguf.GGUFWriter) -> None:
    kinds = {"<pad>": gguf.TokenType.CONTROL, "<bos>": gguf.TokenType.CONTROL, "<eos>": gguf.TokenType.CONTROL,
             "<unk>": gguf.TokenType.UNKNOWN, "<start_of_turn>": gguf.TokenType.CONTROL,
             "<end_of_turn>": gguf.TokenType.CONTROL}
    writer.add_tokenizer_model("llama")
    writer.add_token_list(GEMMA_TOKENS)
    writer.add_token_types([kinds.get(t, gguf.TokenType.BYTE if t.startswith("<0x") else gguf.TokenType.NORMAL)
                            for t in GEMMA_TOKENS])
    writer.add_token_scores([-float(i) for i in range(len(GEMMA_TOKENS))])
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(GEMMA_TEMPLATE)


def write_gguf(hf_dir: Path, arch: str, path: Path,
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32, tokenizer: bool = False) -> Path:
    """The `arch` checkpoint in `hf_dir` as a GGUF: 2-D weights in `qtype` (F32 or a type gguf.quants
    quantizes), norms F32; with `tokenizer`, the Gemma-style vocabulary above (the model's vocab_size
    must be its length). Otherwise no tokenizer: the model readers size the vocabulary from the embedding."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    file_type = {gguf.GGMLQuantizationType.F32: 0, gguf.GGMLQuantizationType.Q8_0: 7}.get(qtype, 1024)
    _write_metadata(writer, cfg, arch, file_type)
    if tokenizer:
        write_gemma_tokenizer(writer)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, cfg["head_dim"]))
    for hf, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        w = _llama_cpp_tensor(hf, tensor.float().numpy(), arch, cfg)
        name = gguf_tensor_name(hf, arch)
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- the oracle ------------------------------------------------------------------------------------------


@torch.no_grad()
def transformers_logits(model_dir: Path, ids: list[int], gguf_file: str | None = None) -> torch.Tensor:
    """[T, vocab] float64: transformers' own model over `ids` in one causal forward (eager attention),
    reading the safetensors of `model_dir` or its GGUF `gguf_file`."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager",
                                                 **kwargs)
    return model(torch.tensor([ids])).logits[0].double()
