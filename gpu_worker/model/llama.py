"""Dense decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma 2/3, Phi-3) over a paged KV cache.

One forward runs every sequence of a step at once (prefill chunks then decodes,
see metadata.py). Every op but the GEMMs goes through the device's backend
(`get_backend(device)`, gpu_worker/ops/backend.py); a GEMM is `linear(x, weight)` on whatever
form the backend put the weight in (`Backend.prepare_weights`: prepacked, quantized or plain).
Q/K/V and gate/up projections are fused into one GEMM each.

Weights arrive with Hugging Face names (`load_weights`), whatever the file format. What the other
architectures do differently from Llama (q/k norms, Gemma's extra norms, GeGLU, windowed and
soft-capped attention) is in layer_variants.py; their layers take these per-op layers, never the
runner's one-call CPU step (runner/cpu_step_layers.py), which computes plain Llama layers only
(ModelConfig.llama_layers).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model import layer_variants
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.model.rope import cos_sin_table
from gpu_worker.model.weight_format import dense_format
from gpu_worker.ops import get_backend
from gpu_worker.ops.backend import Backend, LinearWeight
from gpu_worker.ops.weights.gguf_weight import FileTensor
from gpu_worker.ops.weights.packed_linear import linear

GEMMS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")  # a layer's GEMM weights, in step_layers.c's order


def _param(*shape: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def _replace(module: nn.Module, name: str, value: LinearWeight) -> None:
    """Set attribute `name` of `module`, which may change from a parameter to a submodule."""
    if name in module._parameters:
        del module._parameters[name]
    setattr(module, name, value)


class LlamaDecoderLayer(nn.Module):
    # set by layer_variants.extra_norms where the architecture has them (q/k norms [D], output norms [H])
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    attn_out_norm: torch.Tensor
    mlp_out_norm: torch.Tensor

    def __init__(self, config: ModelConfig, index: int, device, dtype) -> None:
        super().__init__()
        c = config
        kw = dict(device=device, dtype=dtype)
        self.index = index
        for name, size in layer_variants.extra_norms(c).items():  # q/k norms [D], Gemma's output norms [H]
            setattr(self, name, _param(size, **kw))
        self.input_norm = _param(c.hidden_size, **kw)  # [H]
        self.qkv_weight = _param(c.q_size + 2 * c.kv_size, c.hidden_size, **kw)  # [(Hq + 2Hk) * D, H]
        self.qkv_bias = _param(c.q_size + 2 * c.kv_size, **kw) if c.attention_bias else None
        self.o_weight = _param(c.hidden_size, c.q_size, **kw)  # [H, Hq * D]
        self.post_norm = _param(c.hidden_size, **kw)  # [H]
        self.gate_up_weight = _param(2 * c.intermediate_size, c.hidden_size, **kw)  # [2I, H]
        self.down_weight = _param(c.hidden_size, c.intermediate_size, **kw)  # [H, I]
        self.config = config

    def attention(self, ops: Backend, positions, h, meta: AttentionMetadata, k_cache, v_cache,
                  cos_sin) -> torch.Tensor:
        """h: [T, H] (normed) -> attention output projected back to [T, H]."""
        c = self.config
        qkv = linear(h, self.qkv_weight, self.qkv_bias)  # [T, (Hq + 2Hk) * D]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = k.view(-1, c.num_kv_heads, c.head_dim)  # [T, Hk, D]
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)  # [T, Hk, D]
        if c.qk_norm:
            q = layer_variants.head_norm(ops, q, self.q_norm, c.rms_norm_eps)
            k = layer_variants.head_norm(ops, k, self.k_norm, c.rms_norm_eps)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin, c.rope_interleaved)
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if layer_variants.takes_own_attention(c, self.index):
            out = layer_variants.attention(c, self.index, q, k_cache, v_cache, meta)
            return linear(out.view(-1, c.q_size), self.o_weight)  # [T, H]
        out = torch.empty_like(q)  # [T, Hq, D]
        scale = c.attention_scale
        num_prefill = meta.num_prefill_tokens
        if meta.num_prefills > 0:
            out[:num_prefill] = ops.paged_prefill_attention(
                q[:num_prefill], k_cache, v_cache, meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
            )
        if meta.num_decodes > 0:
            out[num_prefill:] = ops.paged_decode_attention(
                q[num_prefill:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
            )
        return linear(out.view(-1, c.q_size), self.o_weight)  # [T, H]

    def forward(self, ops: Backend, positions, h, residual, meta, k_cache, v_cache, cos_sin):
        """h: [T, H] output of the previous layer, residual: [T, H] or None -> (h [T, H], residual [T, H])."""
        eps = self.config.rms_norm_eps
        if residual is None:
            residual, h = h, ops.rms_norm(h, self.input_norm, eps)
        else:
            h, residual = ops.fused_add_rms_norm(h, residual, self.input_norm, eps)
        h = self.attention(ops, positions, h, meta, k_cache, v_cache, cos_sin)
        if self.config.sandwich_norms:
            h = ops.rms_norm(h, self.attn_out_norm, eps)
        h, residual = ops.fused_add_rms_norm(h, residual, self.post_norm, eps)
        gate_up = linear(h, self.gate_up_weight)  # [T, 2I]
        h = linear(layer_variants.activation(self.config, ops)(gate_up), self.down_weight)  # [T, H]
        if self.config.sandwich_norms:
            h = ops.rms_norm(h, self.mlp_out_norm, eps)
        return h, residual


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class LlamaModel(nn.Module):
    """forward(input_ids [T], positions [T], meta, kv_cache) -> logits [num_seqs, vocab] float32."""

    cos_sin: torch.Tensor  # [context_length, D] fp32 buffer: cos | sin of every position
    cos_sin_local: torch.Tensor | None   # the same for Gemma 3's windowed layers (their own rope base)

    def __init__(
        self,
        config: ModelConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        lm_head_dtype: torch.dtype | None = None,
    ) -> None:
        """lm_head_dtype: dtype of the vocab projection; default the backend's choice
        (Backend.logits_dtype: fp32 on CPU, the compute dtype on GPU)."""
        super().__init__()
        c = config
        self.config = config
        # what the GEMMs run on (model/weight_format.py); load_model names it once the backend prepared them
        self.weight_format = dense_format(dtype)
        kw = dict(device=device, dtype=dtype)
        self.embed = _param(c.vocab_size, c.hidden_size, **kw)  # [V, H]
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, i, device, dtype) for i in range(c.num_layers))
        self.norm = _param(c.hidden_size, **kw)  # [H]
        if lm_head_dtype is None:
            lm_head_dtype = get_backend(device).logits_dtype(dtype)
        # tied and same dtype: share the tensor; otherwise a separate parameter (filled from the embedding)
        self.lm_head_dtype = lm_head_dtype
        self.share_lm_head = c.tie_word_embeddings and lm_head_dtype == dtype
        self.lm_head = self.embed if self.share_lm_head else _param(
            c.vocab_size, c.hidden_size, device=device, dtype=lm_head_dtype
        )
        # [context_length, D] fp32 cos | sin; a buffer so .to(device) moves it along
        self.register_buffer("cos_sin", cos_sin_table(c, c.context_length, device), persistent=False)
        # GEMM weights loaded in a GGUF file's own formats (gguf_loader.load_file_formats), by HF name, until
        # map_file_weights makes them the layers' weights; their float parameters stay untouched (unallocated)
        self.file_weights: dict[str, FileTensor] = {}
        # Gemma 3's windowed layers rotate on their own base, unscaled: [context_length, D]
        local = None if c.rope_local_theta is None else dataclasses.replace(
            c, rope_theta=c.rope_local_theta, rope_scaling=None, rope_freq_factors=None)
        local_table = None if local is None else cos_sin_table(local, c.context_length, device)
        self.register_buffer("cos_sin_local", local_table, persistent=False)
        self.layer_weights = layer_variants.layer_weights(c)
        # Gemma's sqrt(hidden_size), rounded to the compute dtype as transformers does
        self.embedding_scale = None if c.embedding_scale is None else float(torch.tensor(c.embedding_scale, dtype=dtype))

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype (use it for the KV cache)."""
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [num_seqs, vocab] float32
        ops = get_backend(input_ids.device)
        h = self.embed_tokens(input_ids)  # [T, H]
        h, residual = self.run_layers(ops, positions, h, meta, kv_cache)
        return self.compute_logits(ops, h, residual, meta)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int64 -> [T, H] (times Gemma's embedding scale)."""
        h = F.embedding(input_ids, self.embed)
        return h if self.embedding_scale is None else h * self.embedding_scale

    def run_layers(self, ops: Backend, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata,
                   kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, H] embeddings -> (last layer's output [T, H], its residual [T, H])."""
        residual: torch.Tensor | None = None
        groups = [meta.for_group(g) for g in range(len(kv_cache.layout.windows))]
        for i, layer in enumerate(self.layers):
            h, residual = layer(ops, positions, h, residual, groups[kv_cache.layout.layer_group[i]],
                                kv_cache.k_caches[i], kv_cache.v_caches[i], self._rope(i))
        assert residual is not None, "a model has at least one layer"
        return h, residual

    def compute_logits(self, ops: Backend, h: torch.Tensor, residual: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """h, residual: [T, H] of the last layer -> logits [num_seqs, V] float32 of the sampled rows."""
        idx = meta.logits_indices  # only the sampled rows need the final norm and the vocab GEMM
        h, _ = ops.fused_add_rms_norm(h[idx], residual[idx], self.norm, self.config.rms_norm_eps)  # [S, H]
        logits = linear(h.to(self.lm_head_dtype), self.lm_head).float()  # [num_seqs, V]
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2

    def _rope(self, layer: int) -> torch.Tensor:
        """The cos/sin table of one layer: the local one for Gemma 3's windowed layers."""
        if self.cos_sin_local is not None and self.config.layer_window(layer) is not None:
            return self.cos_sin_local
        return self.cos_sin

    # ---- weight forms (Backend.prepare_weights converts them; the model only swaps) --------------

    def map_linear_weights(self, convert: Callable[[torch.Tensor], LinearWeight]) -> None:
        """Replace every layer's GEMM weight [N, K] by convert(weight); inference-only afterwards."""
        for layer in self.layers:
            for name in GEMMS:
                _replace(layer, name, convert(getattr(layer, name)))

    def map_file_weights(self, convert: Callable[[list[FileTensor]], LinearWeight]) -> None:
        """Replace every layer GEMM weight loaded as FileTensors, and a vocab head so loaded, by convert(the
        weight's row blocks in order); inference-only afterwards."""
        for i, layer in enumerate(self.layers):
            for name in GEMMS:
                parts = self._file_parts(i, name)
                if parts is not None:
                    _replace(layer, name, convert(parts))
        head = self.file_weights.get("lm_head.weight")
        if head is not None:
            self.set_lm_head(convert([head]))
        self.file_weights.clear()  # the file's bytes are in the kernels' layouts now

    def _file_parts(self, layer: int, param: str) -> list[FileTensor] | None:
        """The FileTensors of a layer's (fused) GEMM parameter in row order, or None."""
        names = [f"model.layers.{layer}.{suffix}" for suffix, (attr, _) in self.layer_weights.items()
                 if attr == param and suffix.endswith(".weight")]
        parts = [self.file_weights.get(name) for name in names]
        return None if any(p is None for p in parts) else [p for p in parts if p is not None]

    def set_lm_head(self, head: LinearWeight) -> None:
        """Replace the vocab projection; the embedding lookup keeps the plain table, so a tied head is untied."""
        _replace(self, "lm_head", head)
        self.share_lm_head = False

    # ---- weight loading -------------------------------------------------------------------------

    def _shard(self, param: torch.Tensor, shard: str | None) -> torch.Tensor:
        """The slice of a (possibly fused) parameter that one HF tensor fills."""
        c = self.config
        bounds = {
            "q": (0, c.q_size), "k": (c.q_size, c.q_size + c.kv_size),
            "v": (c.q_size + c.kv_size, c.q_size + 2 * c.kv_size),
            "gate": (0, c.intermediate_size), "up": (c.intermediate_size, 2 * c.intermediate_size),
        }
        if shard is None:
            return param
        lo, hi = bounds[shard]
        return param[lo:hi]

    def _target(self, name: str) -> torch.Tensor | None:
        """The parameter slice for an HF tensor name (None for tensors the model does not use)."""
        top = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not self.config.tie_word_embeddings:
            top["lm_head.weight"] = self.lm_head
        if name in top:
            return top[name]
        match = _LAYER_NAME.match(name)
        if not match or match.group(2) not in self.layer_weights:
            return None
        layer = self.layers[int(match.group(1))]
        attr, shard = self.layer_weights[match.group(2)]
        param = getattr(layer, attr)
        return None if param is None else self._shard(param, shard)

    def expected_weights(self) -> set[str]:
        """HF names that must all be loaded."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(self.config.num_layers):
            names |= {f"model.layers.{i}.{s}" for s in self.layer_weights}
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | FileTensor]]) -> None:
        """Copy (HF name, tensor) pairs into the (fused) parameters, keeping FileTensors aside for
        map_file_weights; raises if any expected one is missing."""
        loaded = set()
        for name, tensor in weights:
            if isinstance(tensor, FileTensor):
                self.file_weights[name] = tensor
                loaded.add(name)
                continue
            target = self._target(name)
            if target is None:
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
            if name == "model.embed_tokens.weight" and self.config.tie_word_embeddings and not self.share_lm_head:
                self.lm_head.copy_(tensor)
        missing = self.expected_weights() - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
