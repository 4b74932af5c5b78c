"""Every CUDA kernel against its torch reference on random data (needs a GPU and CuPy).

Imports only torch, numpy/cupy (through the ops) and our ops modules: the GPU image lacks the
service dependencies (structlog, grpc, redis).
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.ops import reference
from gpu_worker.ops.cuda import kernels
from gpu_worker.ops.cuda import ops as cuda

REASON = cuda.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no GPU run: {REASON}")]

DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: dict(atol=5e-3, rtol=5e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float32: dict(atol=1e-5, rtol=1e-5)}


def rand(*shape, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def paged_batch(lens, heads, kv_heads, dim, dtype, block_size=16, seed=0):
    """q [B, Hq, D], shuffled paged caches holding `lens` tokens per sequence, block tables, lengths."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 7
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    tables = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    k_cache = rand(num_blocks, block_size, kv_heads, dim, dtype=dtype, seed=seed + 1)
    v_cache = rand(num_blocks, block_size, kv_heads, dim, dtype=dtype, seed=seed + 2)
    q = rand(len(lens), heads, dim, dtype=dtype, seed=seed + 3)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def fp32_oracle(op, q, k_cache, v_cache, *args):
    """The reference op on fp32 copies, cast back: the kernels accumulate in fp32 too."""
    return op(q.float(), k_cache.float(), v_cache.float(), *args).to(q.dtype)


def ragged(n, lo, hi, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


# ------------------------------------------------------------------ paged decode attention

DECODE_CASES = [
    # (lens, heads, kv_heads): split-K (few long sequences) and plain (many sequences), GQA groups 1..8
    ([1], 32, 8),
    ([8192], 32, 8),
    ([1, 15, 16, 17, 8192, 4097], 32, 8),
    (ragged(64, 1, 2048, 1), 32, 8),
    (ragged(128, 1, 8192, 2), 32, 8),
    (ragged(5, 1, 8192, 3), 16, 16),
    (ragged(9, 1, 3000, 4), 9, 3),
    (ragged(7, 1, 5000, 5), 16, 2),
    (ragged(3, 100, 4000, 6), 32, 2),   # group 16: two CTAs per kv head
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("lens", "heads", "kv_heads"), DECODE_CASES)
def test_paged_decode_attention(lens, heads, kv_heads, dim, dtype):
    q, kc, vc, tables, ctx = paged_batch(lens, heads, kv_heads, dim, dtype)
    scale = dim**-0.5
    got = cuda.paged_decode_attention(q, kc, vc, tables, ctx, scale)
    want = fp32_oracle(reference.paged_decode_attention, q, kc, vc, tables, ctx, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_paged_decode_other_block_sizes(block_size, dtype):
    """The config allows 8..64-token blocks; 32 and 64 run as 16-token tiles (no register spills)."""
    q, kc, vc, tables, ctx = paged_batch(ragged(6, 1, 3000, 7), 32, 8, 128, dtype, block_size=block_size)
    got = cuda.paged_decode_attention(q, kc, vc, tables, ctx, 128**-0.5)
    want = fp32_oracle(reference.paged_decode_attention, q, kc, vc, tables, ctx, 128**-0.5)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_paged_decode_bits_do_not_depend_on_batch_or_table_width():
    """A graph replays a padded batch over a full-width table; an eager step runs the real rows over the
    table they need: split-K partitions are fixed, so both give the same bits per sequence."""
    lens = [40, 3000, 257, 16]
    q, kc, vc, tables, ctx = paged_batch(lens, 32, 8, 128, torch.bfloat16)
    padded_tables = torch.zeros(8, tables.shape[1] + 300, dtype=torch.int32, device="cuda")
    padded_tables[:4, : tables.shape[1]] = tables
    padded_ctx = torch.cat([ctx, torch.zeros(4, dtype=torch.int32, device="cuda")])
    padded_q = torch.cat([q, rand(4, 32, 128, dtype=q.dtype, seed=9)])
    eager = cuda.paged_decode_attention(q, kc, vc, tables, ctx, 0.1)
    graph = cuda.paged_decode_attention(padded_q, kc, vc, padded_tables, padded_ctx, 0.1)
    assert torch.equal(graph[:4], eager)


def test_paged_decode_fp32_and_padded_table():
    """fp32 (used by the engine test) and block tables wider than the longest context."""
    q, kc, vc, tables, ctx = paged_batch([3, 40, 700], 8, 2, 64, torch.float32)
    wide = torch.cat([tables, torch.zeros(3, 50, dtype=torch.int32, device="cuda")], dim=1)
    got = cuda.paged_decode_attention(q, kc, vc, wide, ctx, 0.125)
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_paged_decode_in_cuda_graph_replays_with_new_lengths():
    """Launches land on torch's current stream: the op captures into a CUDA graph and replays."""
    q, kc, vc, tables, ctx = paged_batch([100, 2000, 37, 513], 32, 8, 128, torch.bfloat16)
    cuda.paged_decode_attention(q, kc, vc, tables, ctx, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        out = cuda.paged_decode_attention(q, kc, vc, tables, ctx, 0.1)
    ctx.copy_(torch.tensor([1, 17, 2000, 250], dtype=torch.int32))
    q.copy_(rand(*q.shape, dtype=q.dtype, seed=42))
    graph.replay()
    want = fp32_oracle(reference.paged_decode_attention, q, kc, vc, tables, ctx, 0.1)
    torch.testing.assert_close(out, want, **TOL[q.dtype])


# ------------------------------------------------------------------ prefill (gather + SDPA)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_paged_prefill_attention(dtype, dim):
    lens, q_lens = [1, 300, 2048, 77], [1, 300, 512, 5]  # whole prompts and chunks after a prefix
    _, kc, vc, tables, ctx = paged_batch(lens, 32, 8, dim, dtype)
    q = rand(sum(q_lens), 32, dim, dtype=dtype, seed=9)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    got = cuda.paged_prefill_attention(q, kc, vc, tables, starts, ctx, dim**-0.5)
    want = fp32_oracle(reference.paged_prefill_attention, q, kc, vc, tables, starts, ctx, dim**-0.5)
    torch.testing.assert_close(got, want, **TOL[dtype])


# ------------------------------------------------------------------ small ops


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("hidden", [576, 4096, 100])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norms(dtype, hidden, weight_fp32):
    x, res = rand(37, hidden, dtype=dtype, seed=1), rand(37, hidden, dtype=dtype, seed=2)
    w = rand(hidden, dtype=torch.float32 if weight_fp32 else dtype, seed=3)
    torch.testing.assert_close(cuda.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL[dtype])
    got_n, got_r = cuda.fused_add_rms_norm(x, res, w, 1e-6)
    want_n, want_r = reference.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)
    torch.testing.assert_close(got_n, want_n, **TOL[dtype])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dim", [64, 128])
def test_rotary_embedding(dtype, interleaved, dim):
    tokens, heads, kv_heads = 29, 32, 8
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # strided views, as the model passes them
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    angles = torch.arange(8192, device="cuda").float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_pos, D]
    got = cuda.rotary_embedding(positions, q, k, cos_sin, interleaved)
    want = reference.rotary_embedding(positions, q, k, cos_sin, interleaved)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("inter", [1536, 14336, 100])
def test_silu_and_mul(dtype, inter):
    x = rand(19, 2 * inter, dtype=dtype, seed=5)
    torch.testing.assert_close(cuda.silu_and_mul(x), reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("dim", [64, 128])
def test_write_kv_cache(dtype, dim):
    tokens, kv_heads, blocks, bs = 50, 8, 40, 16
    kv = rand(tokens, 2 * kv_heads * dim, dtype=dtype, seed=6)
    k = kv[:, : kv_heads * dim].view(tokens, kv_heads, dim)  # strided views
    v = kv[:, kv_heads * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * bs, device="cuda")[:tokens]
    slots[::7] = -1  # padding tokens are skipped
    caches = [rand(blocks, bs, kv_heads, dim, dtype=dtype, seed=7) for _ in range(2)]
    want = [c.clone() for c in caches]
    cuda.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, want[0], want[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 576, 576), (9, 3072, 576), (64, 576, 1536), (300, 1728, 576)])
def test_int8_linear(dtype, tokens, n, k):
    # up to 64 tokens: int8_gemv.cu; 300 (prefill): dequantize + cuBLAS
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randint(-127, 128, (n, k), generator=gen, device="cuda", dtype=torch.int8)
    scale = torch.rand(n, generator=gen, device="cuda") * 0.02 + 1e-3
    x = rand(tokens, k, dtype=dtype, seed=8)
    want = ((x.double() @ q.double().t()) * scale.double()).to(dtype)
    torch.testing.assert_close(cuda.int8_linear(x, q, scale), want, **TOL[dtype])


def test_int8_linear_rows_are_the_same_bits_in_any_decode_batch():
    gen = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randint(-127, 128, (1536, 576), generator=gen, device="cuda", dtype=torch.int8)
    scale = torch.rand(1536, generator=gen, device="cuda") * 0.02
    x = rand(kernels.INT8_GEMV_MAX_TOKENS, 576, dtype=torch.bfloat16, seed=9)
    full = cuda.int8_linear(x, q, scale)
    for t in (1, 7, 8, 9, 33):
        assert torch.equal(cuda.int8_linear(x[:t], q, scale), full[:t]), t
