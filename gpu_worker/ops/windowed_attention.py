"""Paged attention with a sliding window and score soft-capping (Gemma 2/3, Mistral, Phi-3), in plain
torch on any device: the layers whose attention the C and CUDA kernels do not compute.

Shapes as in reference.py: T tokens of the step (prefills first, then one per decode), Hq/Hk query/kv
heads, D head_dim. A query at position p of a windowed layer sees keys k with p - window < k <= p
(Hugging Face's and llama.cpp's sliding window). Same arguments as the reference's paged attention, plus
`window` and `softcap` (None: off); scores in fp32.

    scores = q . k * scale  ->  cap * tanh(scores / cap)  ->  causal + window mask  ->  softmax . v
"""

from __future__ import annotations

import functools

import torch

from gpu_worker.ops import reference


def _keys(cache: torch.Tensor, block_table: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """cache: [num_blocks, bs, Hk, D], block_table: [max_blocks] -> keys at positions first .. first + n - 1
    [n, Hk, D], n >= end - first, whole blocks from the one holding `first`."""
    bs = cache.shape[1]
    blocks = block_table[first // bs: -(-end // bs)].long()
    return cache.index_select(0, blocks).flatten(0, 1)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            context_len: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q: [L, Hq, D] queries at positions context_len - L .. context_len - 1 of one sequence -> [L, Hq, D]."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, bs = k_cache.shape[2], k_cache.shape[1]
    q_pos = torch.arange(context_len - q_len, context_len, device=q.device)  # [L]
    first = 0 if window is None else max(0, context_len - q_len - window + 1)
    first -= first % bs
    k = _keys(k_cache, block_table, first, context_len).float()  # [C', Hk, D]
    v = _keys(v_cache, block_table, first, context_len).float()
    k_pos = torch.arange(first, first + k.shape[0], device=q.device)  # [C']
    visible = k_pos[None, :] <= q_pos[:, None]  # [L, C']
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    group = num_heads // num_kv_heads
    q_grouped = q.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hk, G, L, D]
    scores = q_grouped @ k.permute(1, 2, 0)[:, None] * scale  # [Hk, G, L, C']
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    out = scores.softmax(dim=-1) @ v.transpose(0, 1)[:, None]  # [Hk, G, L, D]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int | None,
                           softcap: float | None) -> torch.Tensor:
    """reference.paged_decode_attention with a window and a soft-cap: one query per sequence, batched,
    reading nothing on the host (a pure-decode step can be captured in a CUDA graph).

    q: [B, Hq, D], block_tables: [B, W] int32, context_lens: [B] int32 (0 for padding rows) -> [B, Hq, D].
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tables = block_tables.long()
    k = k_cache.index_select(0, tables.flatten()).view(num_seqs, -1, num_kv_heads, head_dim).float()  # [B, W*bs, Hk, D]
    v = v_cache.index_select(0, tables.flatten()).view(num_seqs, -1, num_kv_heads, head_dim).float()
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]  # [1, W*bs]
    lens = context_lens.long()[:, None]  # [B, 1]
    visible = k_pos < lens
    if window is not None:
        visible &= k_pos >= lens - window
    group = num_heads // num_kv_heads
    q_grouped = q.float().view(num_seqs, num_kv_heads, group, head_dim)  # [B, Hk, G, D]
    scores = q_grouped @ k.permute(0, 2, 3, 1) * scale  # [B, Hk, G, W*bs]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = scores.softmax(dim=-1).nan_to_num(0.0) @ v.transpose(1, 2)  # [B, Hk, G, D]; padding rows: 0
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """reference.paged_prefill_attention with a window and a soft-cap: one sequence at a time, reading only
    the blocks inside the window. q: [T, Hq, D], block_tables: [S, max_blocks] int32, query_start_loc:
    [S + 1] int32, context_lens: [S] int32 -> [T, Hq, D]."""
    attend = functools.partial(_attend, window=window, softcap=softcap)
    return reference.prefill_each_sequence(attend, q, k_cache, v_cache, block_tables, query_start_loc,
                                           context_lens, scale)
