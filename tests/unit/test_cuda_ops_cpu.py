"""CPU-checkable parts of the CUDA backend: launch planning, kernel naming/sources, the gather + SDPA
prefill path, and a torch emulation of the split-K (flash-decoding) partition + reduce math."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.ops import cuda, reference

H200_SMS = 132


@pytest.mark.parametrize(
    ("seqs", "kv_heads", "group", "max_blocks", "expected"),
    [
        (64, 8, 4, 128, cuda.DecodePlan(4, 1, 1, 128)),     # 512 CTAs fill 132 SMs: no split
        (256, 8, 4, 512, cuda.DecodePlan(4, 1, 1, 512)),
        (1, 8, 4, 512, cuda.DecodePlan(4, 1, 32, 16)),     # 8 CTAs: 32 partitions of 256 tokens
        (16, 8, 4, 128, cuda.DecodePlan(4, 1, 5, 26)),     # 128 CTAs: split to ~4 per SM
        (1, 8, 4, 16, cuda.DecodePlan(4, 1, 1, 16)),       # 256 tokens: too short to split
        (1, 3, 3, 64, cuda.DecodePlan(4, 1, 4, 16)),       # SmolLM2 shape: GROUP_MAX 4 covers 3 heads
        (2, 2, 16, 64, cuda.DecodePlan(8, 2, 4, 16)),      # group of 16 -> 2 CTAs of 8 heads
    ],
)
def test_plan_decode(seqs, kv_heads, group, max_blocks, expected):
    plan = cuda.plan_decode(seqs, kv_heads, group, max_blocks, 16, H200_SMS)
    assert plan == expected
    assert plan.num_partitions * plan.partition_blocks >= max_blocks  # every block is covered
    assert (plan.num_partitions - 1) * plan.partition_blocks < max_blocks  # no partition wholly past the table


def test_plan_grid_and_group_max():
    assert [cuda.group_max_for(g) for g in (1, 2, 3, 4, 5, 7, 8, 12)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert cuda.DecodePlan(4, 1, 5, 26).grid(16, 8) == (8, 16, 5)
    assert cuda.DecodePlan(8, 2, 1, 64).grid(3, 2) == (4, 3, 1)


def test_vec_width_and_support():
    assert cuda.vec_width(torch.bfloat16, 4096) == 8
    assert cuda.vec_width(torch.float16, 4096, 100) == 1
    assert cuda.vec_width(torch.float32, 576) == 8
    assert cuda.decode_kernel_supports(128, 16, torch.bfloat16)
    assert not cuda.decode_kernel_supports(96, 16, torch.bfloat16)
    assert not cuda.decode_kernel_supports(64, 4, torch.float16)


def test_kernel_names_and_sources():
    assert cuda.decode_kernel_name(torch.bfloat16, 128, 16, 4) == (
        "llmserve::paged_decode_kernel<llmserve::bf16, 128, 16, 4, 4>")
    assert cuda.norm_kernel_name(True, torch.float16, torch.float32, 8, 8) == (
        "llmserve::fused_add_rms_norm_kernel<llmserve::f16, float, 8, 8>")
    for filename in cuda.hot_name_expressions():
        src = cuda.kernel_source(filename)
        assert '#include "common.cuh"' not in src and "namespace llmserve" in src
        # NVRTC ships no CUDA headers and CuPy's include paths vary: the sources include nothing
        assert not [line for line in src.splitlines() if line.lstrip().startswith("#include")]


# ------------------------------------------------------------------ random paged batches


def make_paged(seed: int, lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int = 16,
               dtype=torch.float32):
    """Random q and a shuffled paged cache holding contexts of `lens` tokens."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = len(lens) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def emulate_split_k(q, k_cache, v_cache, tables, lens, scale, plan: cuda.DecodePlan):
    """The kernel's arithmetic per partition (log2-domain max/sum/acc) and the reduce kernel's merge."""
    block_size = k_cache.shape[1]
    part_tokens = plan.partition_blocks * block_size
    seqs, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.zeros(seqs, heads, dim)
    for b in range(seqs):
        ctx = int(lens[b])
        k = reference._gather_blocks(k_cache, tables[b : b + 1], tables.shape[1])[0, :ctx].float()
        v = reference._gather_blocks(v_cache, tables[b : b + 1], tables.shape[1])[0, :ctx].float()
        used = min(plan.num_partitions, -(-ctx // part_tokens))
        for h in range(heads):
            s = (k[:, h // group] @ q[b, h].float()) * (scale * math.log2(math.e))  # [ctx] log2 domain
            maxes, sums, accs = [], [], []
            for p in range(used):
                sp = s[p * part_tokens : (p + 1) * part_tokens]
                m = sp.max()
                w = torch.exp2(sp - m)
                maxes.append(m)
                sums.append(w.sum())
                accs.append(w @ v[p * part_tokens : (p + 1) * part_tokens, h // group])
            if not used:
                continue
            m_all = torch.stack(maxes).max()
            f = torch.exp2(torch.stack(maxes) - m_all)
            out[b, h] = (f[:, None] * torch.stack(accs)).sum(0) / (f * torch.stack(sums)).sum()
    return out


@pytest.mark.parametrize(("lens", "heads", "kv_heads"), [([1, 700, 33, 1024], 8, 2), ([5000], 4, 4), ([600, 17], 6, 2)])
def test_split_k_math_matches_reference(lens, heads, kv_heads):
    q, kc, vc, tables, ctx = make_paged(0, lens, heads, kv_heads, 64)
    plan = cuda.plan_decode(len(lens), kv_heads, heads // kv_heads, tables.shape[1], 16, H200_SMS)
    assert plan.num_partitions > 1
    scale = 64**-0.5
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, scale)
    got = emulate_split_k(q, kc, vc, tables, ctx, scale, plan)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ prefill: gather + SDPA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gather_sdpa_matches_reference(dtype):
    """Chunks that are whole prompts (plain causal) and chunks after a cached prefix (bottom-right causal)."""
    lens, q_lens = [40, 7, 100, 16], [40, 3, 17, 1]
    _, kc, vc, tables, ctx = make_paged(1, lens, 8, 2, 64, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), 8, 64, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = reference.paged_prefill_attention(q, kc, vc, tables, starts, ctx, 0.125)
    got = cuda.paged_prefill_attention(q, kc, vc, tables, starts, ctx, 0.125)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_gather_context_orders_blocks_by_table():
    cache = torch.arange(6 * 4).view(6, 4, 1, 1).float()  # block i holds 4i .. 4i+3
    table = torch.tensor([5, 0, 3], dtype=torch.int32)
    assert cuda.gather_context(cache, table, 10).flatten().tolist() == [20, 21, 22, 23, 0, 1, 2, 3, 12, 13]


# ------------------------------------------------------------------ CUDA-graph static inputs (padding)


def test_static_decode_inputs_pad_rows_write_nothing_and_read_nothing():
    from gpu_worker.model.metadata import AttentionMetadata
    from gpu_worker.ops.cuda_graphs import _StaticDecodeInputs

    static = _StaticDecodeInputs(batch=4, max_blocks=6, device=torch.device("cpu"))
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([33, 70]), num_prefills=0, num_prefill_tokens=0,
        prefill_query_start_loc=torch.zeros(1, **i32), prefill_context_lens=torch.zeros(0, **i32),
        prefill_block_tables=torch.zeros(0, 3, **i32), decode_context_lens=torch.tensor([34, 7], **i32),
        decode_block_tables=torch.tensor([[2, 9, 5], [4, 0, 0]], **i32), logits_indices=torch.arange(2))
    static.block_tables.fill_(99)  # stale rows from an earlier, wider step
    static.load(torch.tensor([11, 12]), torch.tensor([33, 6]), meta)
    assert static.input_ids.tolist() == [11, 12, 0, 0]
    assert static.positions.tolist() == [33, 6, 0, 0]
    assert static.slot_mapping.tolist() == [33, 70, -1, -1]      # padding rows skip the KV write
    assert static.context_lens.tolist() == [34, 7, 0, 0]         # and attend to nothing
    assert static.block_tables[:2].tolist() == [[2, 9, 5, 0, 0, 0], [4, 0, 0, 0, 0, 0]]
    assert static.meta.decode_block_tables is static.block_tables
    assert static.meta.logits_indices.tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------ lane-level emulation of paged_decode_kernel
#
# A numpy transliteration of paged_attention.cu (vectorised over the 32 lanes of a warp): the
# DecodeLayout constants, each lane's chunks (sub + v * L) * 8, the L-lane score reduction, the
# per-token-group online softmax, the xor merges across token groups, the warp merge and the
# split-K partials + reduce. It checks the kernel's indexing and merge logic without a GPU.

import numpy as np  # noqa: E402

NUM_WARPS = 4


def decode_layout(head_dim: int, group_max: int, block_size: int) -> tuple[int, int, int, int]:
    """(VECS_PER_LANE, LANES_PER_TOKEN, TOKENS_PER_WARP, TOKENS_PER_LANE) as in DecodeLayout."""
    vpl = 2 if group_max * head_dim < 256 else 1
    lanes = head_dim // 8 // vpl
    tpw = 32 // lanes
    assert lanes * tpw == 32 and block_size % tpw == 0
    return vpl, lanes, tpw, block_size // tpw


def _group_sum(x: np.ndarray, width: int) -> np.ndarray:
    """warp_sum<width>: every lane gets the sum over its aligned group of `width` lanes."""
    g = x.reshape(32 // width, width, *x.shape[1:]).sum(axis=1, keepdims=True)
    return np.broadcast_to(g, (32 // width, width, *x.shape[1:])).reshape(x.shape)


def emulate_cta(qf, k, v, ctx, blk_begin, blk_end, block_size, group_max):
    """One CTA: qf [GROUP_MAX, D] (pre-scaled, zero rows for absent heads), k/v [>= blocks*bs, D]
    -> (m [G], l [G], acc [G, D]) merged over the CTA, log2 domain."""
    d = qf.shape[1]
    vpl, lanes_per_tok, tpw, tpl = decode_layout(d, group_max, block_size)
    lane = np.arange(32)
    tg, sub = lane // lanes_per_tok, lane % lanes_per_tok
    idx = (sub[:, None, None] + np.arange(vpl)[None, :, None] * lanes_per_tok) * 8 + np.arange(8)  # [32, VPL, 8]
    q_lane = qf[:, idx].transpose(1, 0, 2, 3)  # [32, G, VPL, 8]
    smem_m, smem_l, smem_acc = [], [], []
    for warp in range(NUM_WARPS):
        m = np.full((32, group_max), -3.0e38)
        l = np.zeros((32, group_max))
        acc = np.zeros((32, group_max, vpl, 8))
        for blk in range(blk_begin + warp, blk_end, NUM_WARPS):
            tok = blk * block_size + tg[:, None] + np.arange(tpl)[None, :] * tpw  # [32, TPL]
            valid = tok < ctx
            kf = np.where(valid[..., None, None], k[tok[..., None, None], idx[:, None]], 0.0)  # [32, TPL, VPL, 8]
            vf = np.where(valid[..., None, None], v[tok[..., None, None], idx[:, None]], 0.0)
            dot = _group_sum(np.einsum("lgve,ljve->ljg", q_lane, kf), lanes_per_tok)  # [32, TPL, G]
            s = np.where(valid[..., None], dot, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))
            alpha = np.exp2(m - m_new)
            p = np.exp2(s - m_new[:, None, :])
            l = l * alpha + p.sum(axis=1)
            acc = acc * alpha[..., None, None] + np.einsum("ljg,ljve->lgve", p, vf)
            m = m_new
        mask = lanes_per_tok
        while mask < 32:  # merge_from_lane: xor partners hold the same chunks of other tokens
            partner = lane ^ mask
            m_o, l_o, acc_o = m[partner], l[partner], acc[partner]
            m_new = np.maximum(m, m_o)
            a, b = np.exp2(m - m_new), np.exp2(m_o - m_new)
            l, acc, m = l * a + l_o * b, acc * a[..., None, None] + acc_o * b[..., None, None], m_new
            mask *= 2
        row = np.zeros((group_max, d))
        for ln in range(lanes_per_tok):  # lanes with tg == 0 write their chunks
            for vv in range(vpl):
                row[:, (ln + vv * lanes_per_tok) * 8 : (ln + vv * lanes_per_tok) * 8 + 8] = acc[ln, :, vv]
        smem_m.append(m[0]), smem_l.append(l[0]), smem_acc.append(row)
    sm, sl, sa = np.stack(smem_m), np.stack(smem_l), np.stack(smem_acc)
    m_all = sm.max(axis=0)
    f = np.exp2(sm - m_all)
    return m_all, (sl * f).sum(axis=0), (sa * f[..., None]).sum(axis=0)


def emulate_decode(q, k_cache, v_cache, tables, lens, scale, num_sms=H200_SMS):
    seqs, heads, d = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    plan = cuda.plan_decode(seqs, kv_heads, group, tables.shape[1], bs, num_sms)
    out = np.zeros((seqs, heads, d))
    for b in range(seqs):
        ctx = int(lens[b])
        ctx_blocks = -(-ctx // bs)
        for kh in range(kv_heads):
            k = k_cache[tables[b].long(), :, kh].reshape(-1, d).double().numpy()  # [max_blocks * bs, D]
            v = v_cache[tables[b].long(), :, kh].reshape(-1, d).double().numpy()
            for chunk in range(plan.group_chunks):
                g0 = chunk * plan.group_max
                n = min(plan.group_max, group - g0)
                qf = np.zeros((plan.group_max, d))
                qf[:n] = q[b, kh * group + g0 : kh * group + g0 + n].double().numpy() * scale * math.log2(math.e)
                parts = []
                for p in range(plan.num_partitions):
                    lo = p * plan.partition_blocks
                    hi = min(lo + plan.partition_blocks, ctx_blocks)
                    if plan.num_partitions > 1 and lo >= hi:
                        continue  # the CTA returns; the reduce kernel counts only used partitions
                    parts.append(emulate_cta(qf, k, v, ctx, lo, hi, bs, plan.group_max))
                m = np.stack([x[0] for x in parts])
                f = np.exp2(m - m.max(axis=0))
                l_all = (np.stack([x[1] for x in parts]) * f).sum(axis=0)
                a_all = (np.stack([x[2] for x in parts]) * f[..., None]).sum(axis=0)
                res = np.where(l_all[:, None] > 0, a_all / np.where(l_all > 0, l_all, 1)[:, None], 0.0)
                out[b, kh * group + g0 : kh * group + g0 + n] = res[:n]
    return torch.from_numpy(out).float(), plan


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim", "parts"),
    [
        ([1, 16, 17, 300], 8, 2, 64, 1),   # group 4, D 64: VPL 1
        ([33, 600], 6, 2, 128, 2),         # group 3 -> GROUP_MAX 4, D 128, split-K
        ([700], 8, 8, 128, 2),             # MHA: GROUP_MAX 1, VPL 2
        ([40, 5, 1100], 16, 2, 64, 4),     # group 8; short sequences leave partitions empty
        ([90, 530], 32, 2, 64, 2),         # group 16: two CTAs per kv head
        ([257], 4, 2, 64, 1),              # group 2, VPL 2 at D 64
    ],
)
def test_lane_level_kernel_emulation_matches_reference(lens, heads, kv_heads, dim, parts):
    q, kc, vc, tables, ctx = make_paged(3, lens, heads, kv_heads, dim)
    scale = dim**-0.5
    got, plan = emulate_decode(q, kc, vc, tables, ctx, scale, num_sms=8)  # few SMs: exercises split-K
    assert plan.num_partitions == parts
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
