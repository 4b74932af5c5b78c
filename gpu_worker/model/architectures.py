"""The dense decoder architectures the worker runs, and what sets each apart from Llama.

One registry, read by both config readers (gguf_loader.read_config, hf_loader.load_config) and by
the weight mapping, so adding an architecture is one entry here plus, where it has a new
mechanism, a hook in the decoder layer:

    arch     Hugging Face model_type      GGUF general.architecture   differs from llama by
    llama    llama, mistral               llama                       -
    qwen2    qwen2                        qwen2                       bias on q/k/v
    qwen3    qwen3                        qwen3                       RMSNorm per head on q and k
    gemma2   gemma2                       gemma2                      x sqrt(H) embeddings, GeGLU (gelu-tanh),
                                                                      (1 + w) norms, pre + post norms, logit
                                                                      soft-capping, every 2nd layer windowed
    gemma3   gemma3_text                  gemma3                      as gemma2 without soft-capping, q/k norms,
                                                                      5 of 6 layers windowed on a local rope base
    phi3     phi3                         phi3                        fused qkv and gate_up in the checkpoint

Anything else is refused with UnsupportedModel: one line naming what is wrong and what is supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class UnsupportedModel(ValueError):
    """A checkpoint this worker cannot run (architecture, mixture-of-experts, vision tower, ...).

    str() is one line naming the file, what is unsupported and what is supported.
    """


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_name: str
    # RMSNorm over head_dim on each query and key head, before RoPE
    qk_norm: bool = False
    # Gemma: norms around attention and MLP outputs too (pre_feedforward / post_feedforward)
    sandwich_norms: bool = False
    # added to every checkpoint norm weight to get the multiplier (Gemma's RMSNorm scales by 1 + w;
    # llama.cpp writes 1 + w into the GGUF, so GGUF norms need nothing)
    hf_norm_offset: float = 0.0
    hidden_act: str = "silu"
    scale_embeddings: bool = False
    # every Nth layer attends globally, the rest within the sliding window (GGUF files do not say)
    sliding_window_pattern: int | None = None
    # llama.cpp permuted Q/K rows for interleaved-pair RoPE in this architecture's GGUF
    gguf_qk_permuted: bool = False
    # GGUF tensor suffix -> HF suffix inside a layer, where this architecture differs from llama's
    gguf_layer_names: dict[str, str] = field(default_factory=dict)


_GEMMA_NORMS = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

ARCHITECTURES = {a.name: a for a in (
    Architecture("llama", ("llama", "mistral"), "llama", gguf_qk_permuted=True),
    Architecture("qwen2", ("qwen2",), "qwen2"),
    Architecture("qwen3", ("qwen3",), "qwen3", qk_norm=True, gguf_layer_names=_QK_NORMS),
    Architecture("gemma2", ("gemma2",), "gemma2", sandwich_norms=True, hf_norm_offset=1.0,
                 hidden_act="gelu_tanh", scale_embeddings=True, sliding_window_pattern=2,
                 gguf_layer_names=_GEMMA_NORMS),
    Architecture("gemma3", ("gemma3_text",), "gemma3", qk_norm=True, sandwich_norms=True, hf_norm_offset=1.0,
                 hidden_act="gelu_tanh", scale_embeddings=True, sliding_window_pattern=6,
                 gguf_layer_names={**_GEMMA_NORMS, **_QK_NORMS}),
    Architecture("phi3", ("phi3",), "phi3",
                 gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
)}
_BY_HF_TYPE = {t: a for a in ARCHITECTURES.values() for t in a.hf_model_types}
_BY_GGUF_NAME = {a.gguf_name: a for a in ARCHITECTURES.values()}

SUPPORTED = "llama (Llama 2/3, Mistral, SmolLM2), qwen2, qwen3, gemma2, gemma3, phi3; dense, text only"


def refusal(source: object, what: str) -> UnsupportedModel:
    """The one-line error for `source` (a file or directory): `what` is not supported."""
    return UnsupportedModel(f"{source}: {what} is not supported (supported: {SUPPORTED})")


def for_hf(model_type: str, source: object) -> Architecture:
    """The architecture of a Hugging Face config.json model_type; UnsupportedModel for any other."""
    if model_type not in _BY_HF_TYPE:
        raise refusal(source, f"model_type {model_type!r}")
    return _BY_HF_TYPE[model_type]


def for_gguf(name: str, source: object) -> Architecture:
    """The architecture of a GGUF general.architecture; UnsupportedModel for any other."""
    if name not in _BY_GGUF_NAME:
        raise refusal(source, f"GGUF architecture {name!r}")
    return _BY_GGUF_NAME[name]


def get(name: str) -> Architecture:
    """The architecture of a ModelConfig.architecture ("mistral" runs as llama)."""
    return ARCHITECTURES.get(name) or _BY_HF_TYPE[name]


def sliding_layers(arch: Architecture, num_layers: int) -> tuple[bool, ...]:
    """Which layers attend within the sliding window, by the architecture's fixed pattern
    (Gemma 2: every even layer; Gemma 3: all but every 6th; others: every layer)."""
    pattern = arch.sliding_window_pattern
    if pattern is None:
        return (True,) * num_layers
    return tuple((i + 1) % pattern != 0 for i in range(num_layers))
