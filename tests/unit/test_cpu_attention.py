"""CPU paged decode attention (C kernel over the blocks in place) against the gather + SDPA reference."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.ops import reference
from gpu_worker.ops.cpu import paged_attention as cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler to build the CPU kernel")


def make_case(num_seqs: int, lens: list[int], num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
              block_size: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 200
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    width = -(-max(lens) // block_size) + 1  # one padding column, as the metadata builder pads
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * width].view(num_seqs, width).int()
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("lens,heads,head_dim", [([1], (9, 3), 64), ([37, 16, 5], (9, 3), 64),
                                                 ([200] * 4, (8, 8), 64), ([17, 64], (16, 1), 64),
                                                 ([8, 7, 45], (4, 2), 128), ([8, 7, 45], (4, 2), 20)])
def test_matches_the_reference(lens, heads, head_dim):
    """Whole groups of 8 and 4 tokens take the vector paths, the rest and head sizes not a multiple
    of 8 the scalar one."""
    q, k, v, tables, ctx = make_case(len(lens), lens, *heads, head_dim=head_dim)
    out = cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.125)
    torch.testing.assert_close(out, reference.paged_decode_attention(q, k, v, tables, ctx, 0.125),
                               rtol=1e-5, atol=1e-5)


def test_a_sequence_gets_the_same_bits_in_any_batch():
    q, k, v, tables, ctx = make_case(6, [40, 3, 77, 16, 1, 59], seed=4)
    batch = cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.125)
    for i in range(6):
        alone = cpu_attention.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1, : -(-int(ctx[i]) // 16)],
                                                     ctx[i:i + 1], 0.125)
        assert torch.equal(alone, batch[i:i + 1]), i


def test_reads_only_the_blocks_of_the_table():
    """Poison every block no table names: the output must not change (and stay finite)."""
    q, k, v, tables, ctx = make_case(2, [30, 9], seed=5)
    clean = cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.125)
    used = set(tables[0, :2].tolist()) | set(tables[1, :1].tolist())
    unused = torch.tensor([b for b in range(k.shape[0]) if b not in used])
    k[unused], v[unused] = float("nan"), float("nan")
    assert torch.equal(cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.125), clean)


def test_other_dtypes_fall_back_to_the_reference():
    q, k, v, tables, ctx = make_case(2, [30, 9], seed=6)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.125)
    assert torch.equal(out, reference.paged_decode_attention(q, k, v, tables, ctx, 0.125))


def prefill_case(chunks: list[int], contexts: list[int], seed: int, head_dim: int = 64):
    """One prefill chunk per sequence: chunk i ends at position contexts[i] - 1."""
    _, k, v, tables, ctx = make_case(len(chunks), contexts, head_dim=head_dim, seed=seed)
    q = torch.randn(sum(chunks) + 2, 9, head_dim, generator=torch.Generator().manual_seed(seed + 1))  # 2 padding rows
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, tables, starts, ctx


@pytest.mark.parametrize("chunks,contexts", [([9], [9]), ([73], [73]), ([5, 40, 1], [5, 90, 33]), ([16, 3], [200, 3])])
def test_prefill_matches_the_reference(chunks, contexts):
    q, k, v, tables, starts, ctx = prefill_case(chunks, contexts, seed=7)
    out = cpu_attention.paged_prefill_attention(q, k, v, tables, starts, ctx, 0.125)
    ref = reference.paged_prefill_attention(q, k, v, tables, starts, ctx, 0.125)
    torch.testing.assert_close(out[:sum(chunks)], ref[:sum(chunks)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 32, 20])
def test_a_prefill_token_is_the_same_bits_as_that_token_decoded(head_dim):
    """Token i of a prefill chunk attends exactly as a decode step at its position would, so
    chunking, a prefix hit and the step after a preemption all see the same bits. A chunk's tokens
    share their reads in tiles of up to 16 (their scores two queries at a time in the AVX-512 build,
    an odd one alone) whose contexts straddle the vector paths' groups of 8 tokens (head size 32: the
    vector paths off the usual size; 20: the scalar paths)."""
    chunks, contexts = [12, 30], [12, 47]
    q, k, v, tables, starts, ctx = prefill_case(chunks, contexts, seed=8, head_dim=head_dim)
    out = cpu_attention.paged_prefill_attention(q, k, v, tables, starts, ctx, 0.125)
    for s, (lo, n, c) in enumerate(zip(starts.tolist(), chunks, contexts)):
        for i in range(n):
            decoded = cpu_attention.paged_decode_attention(q[lo + i:lo + i + 1], k, v, tables[s:s + 1],
                                                           torch.tensor([c - n + i + 1], dtype=torch.int32), 0.125)
            assert torch.equal(decoded[0], out[lo + i]), (s, i)
