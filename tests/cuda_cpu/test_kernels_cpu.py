"""Every CUDA kernel, executed on the CPU through gpu_worker.ops.cuda.ops (its planning, split-K, grids and
argument packing), against the torch reference ops: tests/gpu/test_kernels_gpu.py on smaller shapes.

Outputs and shared memory start as NaN, so an element nobody wrote shows; each case also runs with
blocks and threads in reverse and random order, and must give the same bits (else: a race).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DTYPES,
    TOL,
    fp32_oracle,
    paged_batch,
    ragged,
    rand,
    same_bits_in_every_order,
)

from gpu_worker.ops import reference
from gpu_worker.ops.cuda import kernels
from gpu_worker.ops.cuda import ops as cuda

# ------------------------------------------------------------------ paged decode attention

DECODE_CASES = [
    # (lens, heads, kv_heads): every GQA group size class, split-K (contexts over 256 tokens), partial
    # last blocks (lengths off a multiple of 16), and many short sequences
    ([1], 4, 1),
    ([700], 8, 2),                      # 3 partitions
    ([1, 15, 16, 17, 600, 257], 8, 2),  # group 4; empty trailing partitions for the short ones
    (ragged(12, 1, 200, 1), 8, 2),      # no split
    (ragged(3, 1, 900, 3), 4, 4),       # MHA: GROUP_MAX 1
    (ragged(3, 1, 500, 4), 9, 3),       # group 3 in a GROUP_MAX 4 CTA
    (ragged(3, 1, 600, 5), 16, 2),      # group 8
    (ragged(2, 100, 700, 6), 32, 2),    # group 16: two CTAs per kv head
    ([300, 5], 4, 2),                   # group 2
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("lens", "heads", "kv_heads"), DECODE_CASES)
def test_paged_decode_attention(launch_with, lens, heads, kv_heads, dim, dtype):
    q, kc, vc, tables, ctx = paged_batch(lens, heads, kv_heads, dim, dtype)
    scale = dim**-0.5
    with launch_with():
        got = cuda.paged_decode_attention(q, kc, vc, tables, ctx, scale)
    want = fp32_oracle(reference.paged_decode_attention, q, kc, vc, tables, ctx, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])


GROUP_SIZES = {1: 1, 2: 2, 4: 3, 8: 5}  # GROUP_MAX -> a group size it serves (3, 5: padded heads)


@pytest.mark.parametrize("group_max", sorted(GROUP_SIZES))
@pytest.mark.parametrize("block_size", kernels.DECODE_BLOCK_SIZES)
@pytest.mark.parametrize("dim", kernels.DECODE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", kernels.KERNEL_TYPES)
def test_every_decode_variant_in_every_order(launch_with, dtype, dim, block_size, group_max):
    """Each compiled (dtype, head_dim, block_size, GROUP_MAX), split-K with 3 partitions and a partial
    last block, bit-identical in every order."""
    group = GROUP_SIZES[group_max]
    lens = [1, 2 * kernels.PARTITION_TOKENS + block_size + 3]
    q, kc, vc, tables, ctx = paged_batch(lens, group, 1, dim, dtype, block_size, seed=block_size + group)
    scale = dim**-0.5
    got = same_bits_in_every_order(launch_with, lambda: cuda.paged_decode_attention(q, kc, vc, tables, ctx, scale))
    want = fp32_oracle(reference.paged_decode_attention, q, kc, vc, tables, ctx, scale)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got, want, **tol)
    assert kernels.plan_decode(group, tables.shape[1], block_size).num_partitions == 3


def test_paged_decode_fp32_and_padded_table(launch_with):
    """fp32 (used by the engine test) and block tables wider than the longest context."""
    q, kc, vc, tables, ctx = paged_batch([3, 40, 700], 8, 2, 64, torch.float32)
    wide = torch.cat([tables, torch.zeros(3, 50, dtype=torch.int32)], dim=1)
    with launch_with():
        got = cuda.paged_decode_attention(q, kc, vc, wide, ctx, 0.125)
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_bits_do_not_depend_on_batch_or_table_width(launch_with, dtype):
    """A CUDA graph replays a padded batch (rows of context 0) over a full-width block table; an eager
    step runs the real rows over the table the batch needs. Both give the same bits per sequence."""
    lens = [40, 700, 257, 16]
    q, kc, vc, tables, ctx = paged_batch(lens, 8, 2, 128, dtype)
    padded_q = torch.cat([q, rand(4, 8, 128, dtype=dtype, seed=9)])
    padded_tables = torch.cat([torch.cat([tables, torch.zeros(4, 80, dtype=torch.int32)], 1),
                               torch.zeros(4, tables.shape[1] + 80, dtype=torch.int32)])
    padded_ctx = torch.cat([ctx, torch.zeros(4, dtype=torch.int32)])
    with launch_with():
        eager = cuda.paged_decode_attention(q, kc, vc, tables, ctx, 0.1)
        graph = cuda.paged_decode_attention(padded_q, kc, vc, padded_tables, padded_ctx, 0.1)
        alone = [cuda.paged_decode_attention(q[i : i + 1], kc, vc, tables[i : i + 1, : -(-n // 16)], ctx[i : i + 1], 0.1)
                 for i, n in enumerate(lens)]
    assert torch.equal(graph[:4], eager)
    assert torch.equal(graph[4:], torch.zeros_like(graph[4:]))  # padding rows attend to nothing
    assert torch.equal(torch.cat(alone), eager)  # one partition (no reduce) or several: same bits


# ------------------------------------------------------------------ small ops


@pytest.mark.parametrize("dtype", kernels.KERNEL_TYPES)
@pytest.mark.parametrize("hidden", [576, 2048, 100, 300])  # (vec 8, 4 warps) (8, 8) (1, 4) (1, 8)
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norms(launch_with, dtype, hidden, weight_fp32):
    x, res = rand(5, hidden, dtype=dtype, seed=1), rand(5, hidden, dtype=dtype, seed=2)
    w = rand(hidden, dtype=torch.float32 if weight_fp32 else dtype, seed=3)
    got = same_bits_in_every_order(launch_with, lambda: cuda.rms_norm(x, w, 1e-5))
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-5), **TOL[dtype])
    got_n, got_r = same_bits_in_every_order(launch_with, lambda: cuda.fused_add_rms_norm(x, res, w, 1e-6))
    want_n, want_r = reference.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)
    torch.testing.assert_close(got_n, want_n, **TOL[dtype])


@pytest.mark.parametrize("dtype", kernels.KERNEL_TYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dim", [64, 128])
def test_rotary_embedding(launch_with, dtype, interleaved, dim):
    tokens, heads, kv_heads = 7, 8, 2
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # strided views, as the model passes them
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    positions = torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(4))
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(8192).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_pos, D]
    got = same_bits_in_every_order(launch_with, lambda: cuda.rotary_embedding(positions, q, k, cos_sin, interleaved))
    want = reference.rotary_embedding(positions, q, k, cos_sin, interleaved)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("dtype", kernels.KERNEL_TYPES)
@pytest.mark.parametrize("inter", [1536, 100])
def test_silu_and_mul(launch_with, dtype, inter):
    x = rand(3, 2 * inter, dtype=dtype, seed=5)
    got = same_bits_in_every_order(launch_with, lambda: cuda.silu_and_mul(x))
    torch.testing.assert_close(got, reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", kernels.KERNEL_TYPES)
@pytest.mark.parametrize("dim", [64, 128, 36])  # 36: not a multiple of 8 -> scalar copies
def test_write_kv_cache(launch_with, dtype, dim):
    tokens, kv_heads, blocks, bs = 20, 2, 8, 16
    kv = rand(tokens, 2 * kv_heads * dim, dtype=dtype, seed=6)
    k = kv[:, : kv_heads * dim].view(tokens, kv_heads, dim)  # strided views
    v = kv[:, kv_heads * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(6))[:tokens]
    slots[::7] = -1  # padding tokens are skipped
    caches = [rand(blocks, bs, kv_heads, dim, dtype=dtype, seed=7) for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.write_kv_cache(k, v, want[0], want[1], slots)

    def write():
        out = [c.clone() for c in caches]
        cuda.write_kv_cache(k, v, out[0], out[1], slots)
        return tuple(out)

    got = same_bits_in_every_order(launch_with, write)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------ weight-only int8 linear


def int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8 over the whole code range, scale [N] fp32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return q, torch.rand(n, generator=gen) * 0.02 + 1e-3


@pytest.mark.parametrize("dtype", kernels.KERNEL_TYPES)
@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 37, 64), (3, 64, 576), (9, 130, 1536), (64, 20, 96)])
def test_int8_linear(launch_with, dtype, tokens, n, k):
    # 37, 130 rows: a partial last CTA; 9 tokens: a partial second token chunk; 64: the GEMV's largest call
    x = rand(tokens, k, dtype=dtype, seed=8)
    q, scale = int8_weight(n, k, seed=8)
    got = same_bits_in_every_order(launch_with, lambda: cuda.int8_linear(x, q, scale))
    want = ((x.double() @ q.double().t()) * scale.double()).to(dtype)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", kernels.KERNEL_TYPES)
def test_int8_linear_rows_are_the_same_bits_in_any_decode_batch(launch_with, dtype):
    x = rand(kernels.INT8_GEMV_MAX_TOKENS, 576, dtype=dtype, seed=9)
    q, scale = int8_weight(192, 576, seed=9)
    with launch_with():
        batches = {t: cuda.int8_linear(x[:t], q, scale) for t in (1, 2, 7, 8, 9, kernels.INT8_GEMV_MAX_TOKENS)}
    for t, out in batches.items():
        assert torch.equal(out, batches[kernels.INT8_GEMV_MAX_TOKENS][:t]), t
