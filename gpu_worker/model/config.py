"""ModelConfig: the architecture numbers of a dense decoder (llama, qwen2/3, gemma2/3, phi3), whichever
file format they came from. The defaults are Llama's; gpu_worker/model/architectures.py says which
architecture sets which field."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from llmserve.catalog.gguf_metadata import DEFAULT_CONTEXT_LENGTH


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. rope_type "llama3" (Llama 3.1+ smooth interpolation) or "linear"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # per-frequency divisors [head_dim / 2] (GGUF `rope_freqs` tensor); applied on top of rope_theta
    rope_freq_factors: tuple[float, ...] | None = None
    context_length: int = DEFAULT_CONTEXT_LENGTH
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # True: Q/K weights laid out for interleaved-pair RoPE (raw GGUF); False: HF rotate_half layout
    rope_interleaved: bool = False
    architecture: str = "llama"
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on every q and k head before RoPE
    sandwich_norms: bool = False  # Gemma: attention and MLP outputs normed before the residual add
    hidden_act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    # attention scores scaled by query_pre_attn_scalar ** -0.5 (Gemma), None: head_dim ** -0.5
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # a windowed layer's query at p sees keys p - window < k <= p
    # per layer: True = attends within sliding_window (empty: every layer, where sliding_window is set)
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the windowed layers (no scaling there)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"
        assert self.hidden_act in ("silu", "gelu_tanh"), f"unknown activation {self.hidden_act!r}"
        assert not self.sliding_layers or len(self.sliding_layers) == self.num_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer, None where it attends to its whole context."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def llama_layers(self) -> bool:
        """True where every layer is a plain Llama layer (what the one-call CPU step, ops/cpu_step_layers,
        computes): no q/k norms, no extra norms, SwiGLU, no soft-capping, no window, one RoPE base."""
        return (not self.qk_norm and not self.sandwich_norms and self.hidden_act == "silu"
                and self.embedding_scale is None and self.query_pre_attn_scalar is None
                and self.attn_logit_softcap is None and self.final_logit_softcap is None
                and all(self.layer_window(i) is None for i in range(self.num_layers))
                and self.rope_local_theta is None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        raw = json.loads(text)
        if raw.get("rope_scaling"):
            raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        if raw.get("rope_freq_factors") is not None:
            raw["rope_freq_factors"] = tuple(raw["rope_freq_factors"])
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
        raw["sliding_layers"] = tuple(raw.get("sliding_layers") or ())
        return cls(**raw)
