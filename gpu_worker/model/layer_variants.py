"""What a decoder layer does differently per architecture (gpu_worker/model/architectures.py), as small
hooks the Llama layer (llama.py) calls: the gated-MLP activation, the per-head q/k norms, the
attention of windowed or soft-capped layers, the extra norm parameters and the checkpoint names.

Gemma's layer, against Llama's (norm weights are multipliers: Gemma's 1 + w is added at load):

    llama:  h = x + attn(norm(x));            out = h + mlp(norm(h))
    gemma:  h = x + norm(attn(norm(x)));      out = h + norm(mlp(norm(h)))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops import windowed_attention
from gpu_worker.ops.backend import Backend


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> gelu_tanh(x[:, :I]) * x[:, I:]  [T, I] (GeGLU, Gemma)."""
    inter = x.shape[-1] // 2
    return F.gelu(x[:, :inter], approximate="tanh") * x[:, inter:]


def activation(config: ModelConfig, ops: Backend) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated MLP's act-and-mul: the backend's fused SwiGLU, or GeGLU in torch."""
    return ops.silu_and_mul if config.hidden_act == "silu" else gelu_tanh_and_mul


def head_norm(ops: Backend, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over head_dim of every head (Qwen3, Gemma 3 q/k norms). x: [T, heads, D], weight: [D]."""
    return ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def takes_own_attention(config: ModelConfig, layer: int) -> bool:
    """Whether this layer's attention is windowed or soft-capped (windowed_attention), not the kernels'."""
    return config.layer_window(layer) is not None or config.attn_logit_softcap is not None


def attention(config: ModelConfig, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, Hq, D] (prefill tokens first) -> [T, Hq, D] through the sliding window and soft-cap of `layer`."""
    scale, window, cap = config.attention_scale, config.layer_window(layer), config.attn_logit_softcap
    out = torch.empty_like(q)
    n = meta.num_prefill_tokens
    if meta.num_prefills > 0:
        out[:n] = windowed_attention.paged_prefill_attention(
            q[:n], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_context_lens, scale, window, cap)
    if meta.num_decodes > 0:
        out[n:] = windowed_attention.paged_decode_attention(
            q[n:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, window, cap)
    return out


def extra_norms(config: ModelConfig) -> dict[str, int]:
    """Parameter name -> size of the norms a layer has beyond Llama's input and pre-MLP norms."""
    norms: dict[str, int] = {}
    if config.qk_norm:
        norms |= {"q_norm": config.head_dim, "k_norm": config.head_dim}
    if config.sandwich_norms:
        norms |= {"attn_out_norm": config.hidden_size, "mlp_out_norm": config.hidden_size}
    return norms


# HF suffix inside a layer -> (parameter name, which shard of a fused parameter or None)
_LLAMA = {
    "input_layernorm.weight": ("input_norm", None),
    "self_attn.q_proj.weight": ("qkv_weight", "q"),
    "self_attn.k_proj.weight": ("qkv_weight", "k"),
    "self_attn.v_proj.weight": ("qkv_weight", "v"),
    "self_attn.q_proj.bias": ("qkv_bias", "q"),
    "self_attn.k_proj.bias": ("qkv_bias", "k"),
    "self_attn.v_proj.bias": ("qkv_bias", "v"),
    "self_attn.o_proj.weight": ("o_weight", None),
    "post_attention_layernorm.weight": ("post_norm", None),
    "mlp.gate_proj.weight": ("gate_up_weight", "gate"),
    "mlp.up_proj.weight": ("gate_up_weight", "up"),
    "mlp.down_proj.weight": ("down_weight", None),
}
_QK_NORMS = {"self_attn.q_norm.weight": ("q_norm", None), "self_attn.k_norm.weight": ("k_norm", None)}
# Gemma's post_attention_layernorm norms the attention output; its pre_feedforward_layernorm is
# what Llama calls post_attention_layernorm
_SANDWICH = {
    "post_attention_layernorm.weight": ("attn_out_norm", None),
    "pre_feedforward_layernorm.weight": ("post_norm", None),
    "post_feedforward_layernorm.weight": ("mlp_out_norm", None),
}
# Phi-3 stores q/k/v and gate/up already fused, in the order the model fuses them
_FUSED = {"self_attn.qkv_proj.weight": ("qkv_weight", None), "mlp.gate_up_proj.weight": ("gate_up_weight", None)}
_UNFUSED = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight"}


def layer_weights(config: ModelConfig) -> dict[str, tuple[str, str | None]]:
    """HF suffix inside a layer -> (parameter, shard) for this architecture's checkpoints."""
    names = dict(_LLAMA)
    if not config.attention_bias:
        names = {k: v for k, v in names.items() if not k.endswith(".bias")}
    if config.qk_norm:
        names |= _QK_NORMS
    if config.sandwich_norms:
        names |= _SANDWICH
    if config.architecture == "phi3":
        names = {k: v for k, v in names.items() if k not in _UNFUSED} | _FUSED
    return names
