"""The torch reference ops against dense, obviously-correct formulations (float64 oracles)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import ops as ops_pkg
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget
from gpu_worker.ops import reference as ref
from gpu_worker.ops.cpu import layer_ops as cpu_ops
from gpu_worker.ops.cpu.backend import CpuBackend

BLOCK = 16
HQ, HK, D = 6, 2, 32


def make_cache(num_blocks: int = 40, dtype=torch.float32):
    shape = (num_blocks, BLOCK, HK, D)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def make_tables(lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """[S, max_blocks] int32 block tables with shuffled, non-contiguous block ids (padded with 0)."""
    need = [-(-n // BLOCK) for n in lens]
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 left as padding only
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table


def fill_cache(k_cache, v_cache, tables, lens, gen):
    """Write random K/V for every sequence through write_kv_cache; returns dense per-seq K, V [L, Hk, D]."""
    dense = []
    for i, n in enumerate(lens):
        k = torch.randn(n, HK, D, generator=gen)
        v = torch.randn(n, HK, D, generator=gen)
        pos = torch.arange(n)
        slots = tables[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
        ref.write_kv_cache(k, v, k_cache, v_cache, slots)
        dense.append((k, v))
    return dense


def dense_attention(q, k, v, q_positions, scale):
    """q: [L, Hq, D] at q_positions, k/v: [C, Hk, D] -> [L, Hq, D], causal, float64."""
    group = HQ // HK
    k = k.double().repeat_interleave(group, dim=1)  # [C, Hq, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) * scale  # [Hq, L, C]
    allowed = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]  # [L, C]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hlc,chd->lhd", scores.softmax(-1), v)


def test_paged_decode_matches_dense_ragged_gqa():
    gen = torch.Generator().manual_seed(0)
    lens = [1, 17, 33, 50, 16]
    k_cache, v_cache = make_cache()
    tables = make_tables(lens, 40, gen)
    dense = fill_cache(k_cache, v_cache, tables, lens, gen)
    q = torch.randn(len(lens), HQ, D, generator=gen)
    scale = D**-0.5
    out = ref.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale)
    assert out.shape == (len(lens), HQ, D)
    for i, n in enumerate(lens):
        expect = dense_attention(q[i : i + 1], *dense[i], torch.tensor([n - 1]), scale)
        torch.testing.assert_close(out[i].double(), expect[0], rtol=1e-5, atol=1e-5)


def test_paged_decode_bf16_accumulates_in_fp32():
    gen = torch.Generator().manual_seed(1)
    lens = [40, 7]
    k_cache, v_cache = make_cache(dtype=torch.bfloat16)
    tables = make_tables(lens, 40, gen)
    dense = fill_cache(k_cache, v_cache, tables, lens, gen)
    q = torch.randn(2, HQ, D, generator=gen).bfloat16()
    out = ref.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.2)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lens):
        k, v = (t.bfloat16() for t in dense[i])
        expect = dense_attention(q[i : i + 1], k, v, torch.tensor([n - 1]), 0.2)
        torch.testing.assert_close(out[i].double(), expect[0], rtol=2e-2, atol=2e-2)


def test_paged_prefill_matches_dense_causal_with_cached_prefix():
    gen = torch.Generator().manual_seed(2)
    context = [20, 5, 37]  # context length after this step
    q_lens = [20, 5, 9]  # seq 2 is a chunk: its first 28 tokens were cached earlier
    k_cache, v_cache = make_cache()
    tables = make_tables(context, 40, gen)
    dense = fill_cache(k_cache, v_cache, tables, context, gen)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    starts = torch.tensor([0, 20, 25, 34], dtype=torch.int32)
    scale = 0.3
    out = ref.paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, torch.tensor(context, dtype=torch.int32), scale
    )
    for i, (c, n) in enumerate(zip(context, q_lens)):
        lo, hi = int(starts[i]), int(starts[i + 1])
        expect = dense_attention(q[lo:hi], *dense[i], torch.arange(c - n, c), scale)
        torch.testing.assert_close(out[lo:hi].double(), expect, rtol=1e-5, atol=1e-5)


def test_write_kv_cache_places_tokens_and_skips_minus_one():
    k_cache, v_cache = make_cache(num_blocks=4)
    k = torch.arange(3 * HK * D, dtype=torch.float32).view(3, HK, D) + 1
    v = -k
    slots = torch.tensor([2 * BLOCK + 5, -1, 0 * BLOCK + 15])
    ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 5], k[0]) and torch.equal(v_cache[2, 5], v[0])
    assert torch.equal(k_cache[0, 15], k[2]) and torch.equal(v_cache[0, 15], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # token 1 (slot -1) went nowhere


def cos_sin(max_pos: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cat((ang.cos(), ang.sin()), -1).float()


def test_rope_interleaved_equals_half_layout_under_permutation():
    """Interleaved pair (2i, 2i+1) is half-layout pair (i, i + D/2) after permuting the head dim."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, HQ, D, generator=gen), torch.randn(5, HK, D, generator=gen)
    pos = torch.tensor([0, 3, 7, 100, 2])
    table = cos_sin(128, D)
    perm = torch.stack((torch.arange(D // 2), torch.arange(D // 2) + D // 2), -1).flatten()  # half -> interleaved
    q_half, k_half = ref.rotary_embedding(pos, q, k, table, interleaved=False)
    q_int, k_int = ref.rotary_embedding(pos, q[..., perm], k[..., perm], table, interleaved=True)
    torch.testing.assert_close(q_int, q_half[..., perm])
    torch.testing.assert_close(k_int, k_half[..., perm])
    torch.testing.assert_close(q_half[0], q[0])  # position 0 is the identity


def test_rope_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 1, D, generator=gen), torch.randn(1, 1, D, generator=gen)
    table = cos_sin(64, D)

    def score(pq: int, pk: int) -> float:
        qr, _ = ref.rotary_embedding(torch.tensor([pq]), q, q, table, interleaved=False)
        kr, _ = ref.rotary_embedding(torch.tensor([pk]), k, k, table, interleaved=False)
        return float((qr * kr).sum())

    assert score(10, 3) == pytest.approx(score(40, 33), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


def test_rms_norm_and_fused_add():
    gen = torch.Generator().manual_seed(5)
    x, res, w = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen), torch.randn(64, generator=gen)
    expect = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6).double(), expect)
    normed, res_out = ref.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res_out, x + res)
    torch.testing.assert_close(normed, ref.rms_norm(x + res, w, 1e-6))
    assert ref.rms_norm(x.bfloat16(), w, 1e-6).dtype == torch.bfloat16


def test_silu_and_mul():
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])
    expect = torch.tensor([[1.0 / (1 + torch.e**-1.0) * 3.0, -2.0 / (1 + torch.e**2.0) * 4.0]])
    torch.testing.assert_close(ref.silu_and_mul(x), expect)


def test_kv_cache_sizing_and_allocation():
    cfg = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    assert bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 16 * 2
    assert num_blocks_for_budget(cfg, 16, torch.bfloat16, 10 * 6144 + 100) == 10
    assert num_blocks_for_budget(cfg, 16, torch.bfloat16, 100) == 0
    cache = KVCache.allocate(cfg, 10, 16, torch.bfloat16, "cpu")
    assert len(cache.k_caches) == 3 and cache.k_caches[0].shape == (10, 16, 2, 16)
    assert (cache.num_blocks, cache.block_size, cache.nbytes()) == (10, 16, 10 * 6144)


def test_get_backend_and_select_device():
    assert isinstance(ops_pkg.get_backend("cpu"), CpuBackend)
    assert ops_pkg.get_backend("cpu").rms_norm is cpu_ops.rms_norm
    assert ops_pkg.select_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert ops_pkg.select_device("auto") == "cpu"
    with pytest.raises(ValueError):
        ops_pkg.select_device("tpu")
