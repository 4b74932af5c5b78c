"""Plain torch reference ops: the fallback of the CPU backend's C kernels and the oracle the CPU and
CUDA kernels are tested against; `ReferenceBackend` runs a model on nothing else.

Contract: gpu_worker/ops/backend.py. Shapes use T = tokens in the step, Hq/Hk = query/kv heads,
D = head_dim, B = decoding sequences, S = prefilling sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_worker.ops.backend import Backend, PreparableModel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H], weight: [H] -> [T, H] (computed in fp32, cast back to x.dtype)."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) [T, H], x + residual [T, H])."""
    residual_out = x + residual
    return rms_norm(residual_out, weight, eps), residual_out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [T, H, D] fp32, cos/sin: [T, 1, D/2] -> [T, H, D] rotated."""
    if interleaved:  # pairs (2i, 2i+1): GGUF / Meta layout
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = x.shape[-1] // 2  # pairs (i, i + D/2): Hugging Face rotate_half layout
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64, q: [T, Hq, D], k: [T, Hk, D], cos_sin: [max_pos, D] fp32
    -> (q_rot [T, Hq, D], k_rot [T, Hk, D])."""
    half = q.shape[-1] // 2
    table = cos_sin[positions].unsqueeze(1)  # [T, 1, D]
    cos, sin = table[..., :half], table[..., half:]
    q_rot = _rotate(q.float(), cos, sin, interleaved).to(q.dtype)
    k_rot = _rotate(k.float(), cos, sin, interleaved).to(k.dtype)
    return q_rot, k_rot


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> silu(x[:, :I]) * x[:, I:]  [T, I]."""
    inter = x.shape[-1] // 2
    return F.silu(x[:, :inter]) * x[:, inter:]


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D] written in place into k_cache, v_cache: [num_blocks, block_size, Hk, D]
    at flat slot slot_mapping[t] (= block * block_size + offset); slot -1 is skipped."""
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, Hk, D]
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache: [num_blocks_total, bs, Hk, D], block_tables: [B, >=num_blocks] -> [B, num_blocks * bs, Hk, D]."""
    table = block_tables[:, :num_blocks].long()  # [B, num_blocks]
    blocks = cache.index_select(0, table.flatten())  # [B * num_blocks, bs, Hk, D]
    return blocks.view(table.shape[0], num_blocks * cache.shape[1], *cache.shape[2:])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its cached context, in one batched masked SDPA call.

    q: [B, Hq, D], k_cache/v_cache: [num_blocks, bs, Hk, D], block_tables: [B, max_blocks] int32,
    context_lens: [B] int32 -> [B, Hq, D]. Query head h reads kv head h // (Hq // Hk).

    GQA is folded into the query axis: the G = Hq / Hk query heads sharing a kv head become G
    "queries" of one SDPA head, so K/V are read once and never repeated. Torch's CPU SDPA kernel
    accumulates bf16/fp16 in fp32.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-int(context_lens.max()) // block_size)
    k = _gather_blocks(k_cache, block_tables, num_blocks).transpose(1, 2)  # [B, Hk, L, D]
    v = _gather_blocks(v_cache, block_tables, num_blocks).transpose(1, 2)
    key_pos = torch.arange(k.shape[2], device=q.device)
    valid = key_pos[None, :] < context_lens.to(q.device).long()[:, None]  # [B, L]
    q_grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hk, G, D]
    out = F.scaled_dot_product_attention(
        q_grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=valid[:, None, None, :], scale=scale
    )  # [B, Hk, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_len: int, scale: float,
) -> torch.Tensor:
    """q: [L, Hq, D] queries at context positions context_len - L .. context_len - 1 -> [L, Hq, D].

    GQA folded as in decode: [Hk, G * L, D] queries against [Hk, C, D] keys, the causal mask tiled G times.
    """
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-context_len // block_size)
    k = _gather_blocks(k_cache, block_table[None], num_blocks)[0, :context_len]  # [C, Hk, D]
    v = _gather_blocks(v_cache, block_table[None], num_blocks)[0, :context_len]
    q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
    causal = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # [L, C]
    q_grouped = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hk, G, L, D]
    out = F.scaled_dot_product_attention(
        q_grouped.reshape(num_kv_heads, group * q_len, head_dim),
        k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
        attn_mask=causal.repeat(group, 1), scale=scale,
    )  # [Hk, G * L, D]
    return out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each prefill chunk over its sequence's cached context.

    q: [T, Hq, D], block_tables: [S, max_blocks] int32, query_start_loc: [S + 1] int32,
    context_lens: [S] int32 -> [T, Hq, D].
    """
    return prefill_each_sequence(_prefill_one, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                 scale)


# attend(q [L, Hq, D], k_cache, v_cache, block_table [max_blocks], context_len, scale) -> [L, Hq, D]
PrefillOne = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def prefill_each_sequence(
    attend: PrefillOne,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_prefill_attention as a loop of `attend` over the step's prefilling sequences (a step holds
    few, so a loop is fine); it reads the lengths on the host. Arguments as paged_prefill_attention's."""
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for i, context_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        if hi > lo:
            out[lo:hi] = attend(q[lo:hi], k_cache, v_cache, block_tables[i], context_len, scale)
    return out


class ReferenceBackend(Backend):
    """Every op in plain torch; weights stay as loaded (F.linear)."""

    name = "reference"
    rms_norm = staticmethod(rms_norm)
    fused_add_rms_norm = staticmethod(fused_add_rms_norm)
    rotary_embedding = staticmethod(rotary_embedding)
    silu_and_mul = staticmethod(silu_and_mul)
    write_kv_cache = staticmethod(write_kv_cache)
    paged_decode_attention = staticmethod(paged_decode_attention)
    paged_prefill_attention = staticmethod(paged_prefill_attention)

    def compute_dtype(self) -> torch.dtype:
        return torch.float32

    def logits_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """fp32: bf16 logits round near-ties together and flip greedy choices."""
        return torch.float32

    def runs_file_formats(self, dtype: torch.dtype) -> bool:
        return False

    def prepare_weights(self, model: PreparableModel, quantization: str) -> bool:
        if quantization != "none":
            raise ValueError(f"the reference backend runs plain weights, not {quantization!r}")
        return False
