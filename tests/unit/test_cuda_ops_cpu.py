"""CPU-checkable parts of the CUDA backend that need no kernel: launch planning, kernel naming/sources,
the gather + SDPA prefill path, CUDA-graph static inputs. The kernels themselves run on the CPU in
tests/cuda_cpu."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from gpu_worker.ops import reference
from gpu_worker.ops.cuda import kernels
from gpu_worker.ops.cuda import ops as cuda


@pytest.mark.parametrize(
    ("group", "max_blocks", "block_size", "expected"),
    [
        (4, 128, 16, kernels.DecodePlan(4, 1, 8, 16)),   # 2048 tokens: 8 partitions of 256
        (4, 16, 16, kernels.DecodePlan(4, 1, 1, 16)),    # 256 tokens: one partition, no reduce
        (4, 17, 16, kernels.DecodePlan(4, 1, 2, 16)),
        (3, 64, 16, kernels.DecodePlan(4, 1, 4, 16)),    # SmolLM2 shape: GROUP_MAX 4 covers 3 heads
        (16, 64, 16, kernels.DecodePlan(8, 2, 4, 16)),   # group of 16 -> 2 CTAs of 8 heads
        (1, 10, 64, kernels.DecodePlan(1, 1, 3, 4)),     # 64-token blocks: 4 per partition
        (8, 40, 8, kernels.DecodePlan(8, 1, 2, 32)),
    ],
)
def test_plan_decode(group, max_blocks, block_size, expected):
    plan = kernels.plan_decode(group, max_blocks, block_size)
    assert plan == expected
    assert plan.partition_blocks * block_size == kernels.PARTITION_TOKENS  # fixed: batch-independent bits
    assert plan.num_partitions * plan.partition_blocks >= max_blocks  # every block is covered
    assert (plan.num_partitions - 1) * plan.partition_blocks < max_blocks  # no partition wholly past the table


def test_plan_grid_and_group_max():
    assert [kernels.group_max_for(g) for g in (1, 2, 3, 4, 5, 7, 8, 12)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert kernels.DecodePlan(4, 1, 5, 26).grid(16, 8) == (8, 16, 5)
    assert kernels.DecodePlan(8, 2, 1, 64).grid(3, 2) == (4, 3, 1)


def test_vec_width_and_support():
    assert kernels.vec_width(torch.bfloat16, 4096) == 8
    assert kernels.vec_width(torch.float16, 4096, 100) == 1
    assert kernels.vec_width(torch.float32, 576) == 8
    assert kernels.decode_kernel_supports(128, 16, torch.bfloat16)
    assert not kernels.decode_kernel_supports(96, 16, torch.bfloat16)
    assert not kernels.decode_kernel_supports(64, 4, torch.float16)
    assert all(kernels.decode_kernel_supports(64, bs, torch.float16) for bs in (8, 16, 32, 64))  # the config's sizes


def test_kernel_names_and_sources():
    assert kernels.decode_kernel_name(torch.bfloat16, 128, 16, 4) == (
        "llmserve::paged_decode_kernel<llmserve::bf16, 128, 16, 4, 4>")
    assert kernels.norm_kernel_name(True, torch.float16, torch.float32, 8, 8) == (
        "llmserve::fused_add_rms_norm_kernel<llmserve::f16, float, 8, 8>")
    for filename in kernels.hot_name_expressions():
        src = kernels.kernel_source(filename)
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
    from gpu_worker.runner.cuda_graphs import _StaticDecodeInputs

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


# ------------------------------------------------------------------ GPU-only hazards


def _decode_meta(batch: int, max_blocks: int):
    from gpu_worker.model.metadata import AttentionMetadata

    i32 = dict(dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64), num_prefills=0, num_prefill_tokens=0,
        prefill_query_start_loc=torch.zeros(1, **i32), prefill_context_lens=torch.zeros(0, **i32),
        prefill_block_tables=torch.zeros(0, max_blocks, **i32), decode_context_lens=torch.ones(batch, **i32),
        decode_block_tables=torch.zeros(batch, max_blocks, **i32), logits_indices=torch.arange(batch))


@pytest.mark.parametrize(("head_dim", "block_size", "reason"), [(96, 16, "head_dim 96"), (64, 12, "block_size 12"),
                                                                (64, 16, None)])
def test_decode_graphs_stay_off_where_attention_falls_back_to_the_reference(head_dim, block_size, reason):
    """The reference decode reads context lengths on the host: capturing it would fail, so such a
    cache runs every step eagerly (and capture() touches no CUDA API)."""
    from types import SimpleNamespace

    from gpu_worker.model.kv_cache import KVLayout
    from gpu_worker.runner.cuda_graphs import DecodeGraphRunner

    cache = SimpleNamespace(k_caches=[torch.zeros(4, block_size, 2, head_dim, dtype=torch.float16)],
                            layout=KVLayout.single(1))
    calls = []
    runner = DecodeGraphRunner(None, cache, batch_sizes=(1, 4), max_blocks=8,
                               forward=lambda ids, pos, meta: calls.append(ids.shape[0]) or ids)
    if reason is None:
        assert runner.disabled_reason is None
        return
    assert reason in runner.disabled_reason
    runner.capture()
    meta = _decode_meta(3, 8)
    assert runner.graph_batch(3, meta) is None
    runner.run(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), meta)
    assert calls == [3]  # eager, unpadded


NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: pre-sm_80 bf16 build NOT checked")
def test_bf16_kernels_build_for_gpus_before_sm80(tmp_path):
    """bf16 is torch's default wherever it says bf16 is supported, sm_75 included: the bf16 kernels
    must not use sm_80-only instructions (cvt.rn.bf16.f32)."""
    bf16 = [e for exprs in kernels.hot_name_expressions().values() for e in exprs if "bf16" in e]
    for filename, expressions in kernels.hot_name_expressions().items():
        keep = ", ".join(f"(void*)&{e}" for e in expressions if e in bf16)
        tu = tmp_path / f"{filename}_sm75.cu"
        tu.write_text(f'#include "{kernels.KERNEL_DIR / filename}"\nvoid* keep[] = {{{keep}}};\n')
        proc = subprocess.run([NVCC, "-std=c++17", "-arch=sm_75", "-cubin", "-o", str(tu.with_suffix(".cubin")),
                               str(tu)], capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"{filename} for sm_75:\n{proc.stderr[-3000:]}"
