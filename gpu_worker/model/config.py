"""ModelConfig: the architecture numbers of a Llama-family decoder, whichever file format they came from."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from llmserve.gguf_metadata import DEFAULT_CONTEXT_LENGTH


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

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"

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
        return cls(**raw)
