"""ops/windowed_attention.py: without window or cap it equals the reference paged attention; with them,
a dense masked attention over each sequence; padding decode rows (context 0) give zeros, not NaN."""

from __future__ import annotations

import torch

from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops import reference, windowed_attention


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, window, cap) -> torch.Tensor:
    """Prefill rows, then decode rows, as a layer calls the two (layer_variants.attention)."""
    n = meta.num_prefill_tokens
    pre = windowed_attention.paged_prefill_attention(q[:n], k_cache, v_cache, meta.prefill_block_tables,
                                                     meta.prefill_query_start_loc, meta.prefill_context_lens,
                                                     scale, window, cap)
    dec = windowed_attention.paged_decode_attention(q[n:], k_cache, v_cache, meta.decode_block_tables,
                                                    meta.decode_context_lens, scale, window, cap)
    return torch.cat([pre, dec])

HQ, HK, D, BS = 4, 2, 8, 4
TABLES = [[3, 0, 5, 1, 7], [2, 6, 4, 8, 9]]


def _step(prefill_lens: list[tuple[int, int]], decode_lens: list[int]) -> AttentionMetadata:
    """prefill_lens: (chunk length, context length after the step) of sequence 0.. ; decodes follow."""
    i32 = torch.int32
    starts = [0]
    for q_len, _ in prefill_lens:
        starts.append(starts[-1] + q_len)
    n_pre = len(prefill_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_prefills=n_pre, num_prefill_tokens=starts[-1],
        prefill_query_start_loc=torch.tensor(starts, dtype=i32),
        prefill_context_lens=torch.tensor([c for _, c in prefill_lens], dtype=i32),
        prefill_block_tables=torch.tensor(TABLES[:n_pre], dtype=i32).view(n_pre, -1),
        decode_context_lens=torch.tensor(decode_lens, dtype=i32),
        decode_block_tables=torch.tensor([(TABLES[n_pre:] + [[0] * 5] * 2)[j] for j in range(len(decode_lens))],
                                         dtype=i32).view(len(decode_lens), -1),
        logits_indices=torch.zeros(0, dtype=torch.int64),
    )


def _dense(q, k, v, q_pos, scale, window, cap):
    """q: [L, Hq, D] at positions q_pos, k/v: [C, Hk, D] -> [L, Hq, D], float64, heads repeated."""
    k, v = k.double().repeat_interleave(HQ // HK, 1), v.double().repeat_interleave(HQ // HK, 1)
    s = torch.einsum("lhd,chd->hlc", q.double(), k) * scale
    if cap:
        s = torch.tanh(s / cap) * cap
    kp = torch.arange(k.shape[0])
    mask = (kp[None] <= q_pos[:, None]) & ((kp[None] > q_pos[:, None] - window) if window else True)
    return torch.einsum("hlc,chd->lhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)


def test_no_window_no_cap_is_the_reference():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(10, BS, HK, D, generator=gen), torch.randn(10, BS, HK, D, generator=gen)
    meta = _step([(5, 13)], [17])
    q = torch.randn(6, HQ, D, generator=gen)
    ours = paged_attention(q, k_cache, v_cache, meta, 0.3, None, None)
    pre = reference.paged_prefill_attention(q[:5], k_cache, v_cache, meta.prefill_block_tables,
                                            meta.prefill_query_start_loc, meta.prefill_context_lens, 0.3)
    dec = reference.paged_decode_attention(q[5:], k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_context_lens, 0.3)
    torch.testing.assert_close(ours, torch.cat([pre, dec]), rtol=1e-5, atol=1e-5)


def test_window_and_cap_match_dense_attention_and_padding_rows_are_zero():
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(10, BS, HK, D, generator=gen) * 3, torch.randn(10, BS, HK, D, generator=gen)
    meta = _step([(6, 15)], [11, 0])  # one chunk over a cached prefix, one decode, one padding row
    q = torch.randn(8, HQ, D, generator=gen) * 3
    ours = paged_attention(q, k_cache, v_cache, meta, 0.5, 5, 2.0)

    def context(seq, n):
        return k_cache[TABLES[seq]].flatten(0, 1)[:n], v_cache[TABLES[seq]].flatten(0, 1)[:n]

    k, v = context(0, 15)
    torch.testing.assert_close(ours[:6].double(), _dense(q[:6], k, v, torch.arange(9, 15), 0.5, 5, 2.0),
                               rtol=1e-5, atol=1e-5)
    k, v = context(1, 11)
    torch.testing.assert_close(ours[6:7].double(), _dense(q[6:7], k, v, torch.tensor([10]), 0.5, 5, 2.0),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[7], torch.zeros(HQ, D))
