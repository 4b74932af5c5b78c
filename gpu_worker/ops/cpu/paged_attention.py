"""Paged attention on the CPU that reads K/V blocks in place (paged_attention.c).

The torch reference (`reference.paged_decode_attention`) first gathers every decoding
sequence's blocks into a dense [B, L, Hk, D] copy, then runs SDPA over it: that copy grows
with every sequence's context and becomes a large share of a decode step (docs/performance.md).
The C kernel walks each sequence's block table instead, so K and V are read once and never
written.

Prefill runs through the same kernel: each prefill token is one query over its sequence's
context up to and including itself. So a token's attention is the same bits whether a prefill
(chunked or not, prefix hit or miss) or a decode step computes it, and a prefill costs one call
instead of a gather, a mask and an SDPA per sequence.

The kernel is a small C file built on first use (ops/cpu/build.py). Where it cannot be
built, or the cache is not fp32, both functions fall back to the reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from gpu_worker.ops import reference
from gpu_worker.ops.cpu import build

_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (ops/cpu/build.py), built on first use; None where it cannot be built."""
    return build.bind("paged_attention", {"paged_decode_attention_f32": (_ARGS, ctypes.c_int)})


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as `reference.paged_decode_attention`.

    q: [B, Hq, D], k_cache/v_cache: [num_blocks, bs, Hk, D], block_tables: [B, max_blocks] int32,
    context_lens: [B] int32 -> [B, Hq, D]. Query head h reads kv head h // (Hq // Hk).
    """
    lib = library()
    if lib is None or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    with build.traced("cpu_paged_decode_attention"):
        rc = lib.paged_decode_attention_f32(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(tables), _ptr(lens), _ptr(out),
            num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], tables.shape[1],
            scale, min(torch.get_num_threads(), num_seqs),  # a thread per sequence at most
        )
    if rc != 0:
        raise MemoryError(f"cpu paged attention: no memory for the scratch of {num_seqs} queries")
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as `reference.paged_prefill_attention`: q: [T, Hq, D], block_tables:
    [S, max_blocks], query_start_loc: [S + 1], context_lens: [S] -> [T, Hq, D]. Sequence s's
    chunk ends at position context_lens[s] - 1, so its token i sees the first
    context_lens[s] - chunk_len + i + 1 positions."""
    if library() is None or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                                 context_lens, scale)
    tables, token_lens = prefill_token_queries(block_tables, query_start_loc, context_lens)
    total = token_lens.shape[0]
    out = torch.empty_like(q)
    out[:total] = paged_decode_attention(q[:total], k_cache, v_cache, tables, token_lens, scale)
    return out


def prefill_token_queries(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prefill token as one decode-style query: its sequence's block table [T, max_blocks] and
    the context it sees [T] (up to and including itself), for the arguments of paged_prefill_attention."""
    starts = query_start_loc.long()
    chunk_lens = starts[1:] - starts[:-1]
    seq_of = torch.repeat_interleave(torch.arange(len(chunk_lens)), chunk_lens)
    within = torch.arange(int(starts[-1])) - starts[:-1][seq_of]
    return block_tables[seq_of], context_lens.long()[seq_of] - chunk_lens[seq_of] + within + 1
