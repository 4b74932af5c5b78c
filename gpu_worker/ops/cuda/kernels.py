"""The CUDA kernels' catalogue: where the .cu sources are, which template instantiations exist, and
how a launch is planned. Plain Python over shapes (no CuPy), so it is unit-tested on the CPU; the ops
that launch them are in ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parent  # the .cu files beside this module
NVRTC_OPTIONS = ("--std=c++17",)
# C++ element type per torch dtype (common.cuh: 16-bit types are storage structs, no CUDA headers)
CTYPE = {torch.float16: "llmserve::f16", torch.bfloat16: "llmserve::bf16", torch.float32: "float"}
HALF_TYPES = (torch.float16, torch.bfloat16)
KERNEL_TYPES = (*HALF_TYPES, torch.float32)

# Paged decode attention launch constants (see paged_attention.cu).
DECODE_WARPS = 4
DECODE_HEAD_DIMS = (64, 128)  # others fall back to the torch reference (correct, not fast)
DECODE_BLOCK_SIZES = (8, 16, 32, 64)  # every size the worker config allows
# Split-K partitions have this fixed length, so where a sequence's context is split (and so the bits
# of its output) never depends on the batch it runs in, the block-table width, or whether a CUDA
# graph (padded batch, full-width table) or an eager step launched it.
PARTITION_TOKENS = 256


# ---------------------------------------------------------------- launch planning (pure Python)


@dataclass(frozen=True)
class DecodePlan:
    """How paged_decode_attention is launched; a function of shapes only (CUDA-graph safe)."""

    group_max: int         # query heads per CTA (template GROUP_MAX: 1, 2, 4 or 8)
    group_chunks: int      # CTAs per kv head: ceil(group_size / group_max)
    num_partitions: int    # split-K partitions of the context (1 = no split, no reduce kernel)
    partition_blocks: int  # KV blocks per partition

    def grid(self, num_seqs: int, num_kv_heads: int) -> tuple[int, int, int]:
        return (num_kv_heads * self.group_chunks, num_seqs, self.num_partitions)


def group_max_for(group_size: int) -> int:
    """Smallest compiled GROUP_MAX >= group_size (groups above 8 are split over CTAs)."""
    for cap in (1, 2, 4, 8):
        if group_size <= cap:
            return cap
    return 8


def plan_decode(group_size: int, max_blocks: int, block_size: int) -> DecodePlan:
    """Split-K into PARTITION_TOKENS-long partitions whenever the block table is longer than one.

    A sequence that fits one partition gets the same bits either way (the reduce of one partial is
    exact), and partitions past a sequence's context do no work, so the plan may follow the table."""
    group_max = group_max_for(group_size)
    partition_blocks = max(1, PARTITION_TOKENS // block_size)
    num_partitions = max(1, -(-max_blocks // partition_blocks))
    return DecodePlan(group_max, -(-group_size // group_max), num_partitions, partition_blocks)


def decode_kernel_supports(head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """The compiled layouts cover head_dim 64/128 and the configurable block sizes."""
    return head_dim in DECODE_HEAD_DIMS and block_size in DECODE_BLOCK_SIZES and dtype in KERNEL_TYPES


def vec_width(dtype: torch.dtype, *sizes: int) -> int:
    """8-element chunks (16-byte accesses) for rows whose sizes divide by 8, else 1 element."""
    return 8 if all(s % 8 == 0 for s in sizes) else 1

# Weight-only int8 linear launch constants (see int8_gemv.cu): tokens per CTA (the weights are
# read once for them) and warps (output rows) per CTA. Calls with more tokens than
# INT8_GEMV_MAX_TOKENS (prefill) dequantize the weight and use cuBLAS instead.
INT8_GEMV_TOKENS = 8
INT8_GEMV_WARPS = 4
INT8_GEMV_MAX_TOKENS = 64


def norm_warps(hidden: int, vec: int) -> int:
    return 8 if hidden // vec >= 256 else 4


def decode_kernel_name(dtype: torch.dtype, head_dim: int, block_size: int, group_max: int) -> str:
    return f"llmserve::paged_decode_kernel<{CTYPE[dtype]}, {head_dim}, {block_size}, {group_max}, {DECODE_WARPS}>"


def reduce_kernel_name(dtype: torch.dtype, head_dim: int) -> str:
    return f"llmserve::paged_decode_reduce_kernel<{CTYPE[dtype]}, {head_dim}>"


def norm_kernel_name(fused: bool, dtype: torch.dtype, wdtype: torch.dtype, vec: int, warps: int) -> str:
    name = "fused_add_rms_norm_kernel" if fused else "rms_norm_kernel"
    return f"llmserve::{name}<{CTYPE[dtype]}, {CTYPE[wdtype]}, {vec}, {warps}>"


def int8_gemv_kernel_name(dtype: torch.dtype) -> str:
    return f"llmserve::int8_gemv_kernel<{CTYPE[dtype]}, {INT8_GEMV_TOKENS}, {INT8_GEMV_WARPS}>"


def hot_name_expressions() -> dict[str, list[str]]:
    """Kernel instantiations per .cu file that the compile test builds ahead of time with nvcc
    (at run time NVRTC instantiates whichever variant a call needs)."""
    attn = []
    for dtype in HALF_TYPES:
        for head_dim in (64, 128):
            attn += [decode_kernel_name(dtype, head_dim, 16, g) for g in (1, 2, 4, 8)]
            attn.append(reduce_kernel_name(dtype, head_dim))
    # the larger configurable block sizes, in one dtype: they must not spill either
    attn += [decode_kernel_name(torch.bfloat16, head_dim, bs, g) for head_dim in (64, 128) for bs in (32, 64)
             for g in (1, 2, 4, 8)]
    norms, act, rope, kv = [], [], [], []
    for dtype in HALF_TYPES:
        t = CTYPE[dtype]
        for fused in (False, True):
            norms += [norm_kernel_name(fused, dtype, w, 8, 8) for w in (dtype, torch.float32)]
        act.append(f"llmserve::silu_and_mul_kernel<{t}, 8>")
        rope += [f"llmserve::rotary_kernel<{t}, {'true' if i else 'false'}>" for i in (True, False)]
        kv.append(f"llmserve::write_kv_cache_kernel<{t}, 8>")
    return {"paged_attention.cu": attn, "layernorm.cu": norms, "activation.cu": act,
            "rotary.cu": rope, "kv_cache.cu": kv, "int8_gemv.cu": [int8_gemv_kernel_name(d) for d in HALF_TYPES]}


def launchable_kernels() -> dict[str, list[str]]:
    """Every kernel instantiation the ops below can launch, per .cu file (tests/cuda_cpu runs each)."""
    weights = {dtype: (dtype, torch.float32) if dtype in HALF_TYPES else (dtype,) for dtype in KERNEL_TYPES}
    attn = [decode_kernel_name(dtype, dim, bs, g) for dtype in KERNEL_TYPES for dim in DECODE_HEAD_DIMS
            for bs in DECODE_BLOCK_SIZES for g in (1, 2, 4, 8)]
    attn += [reduce_kernel_name(dtype, dim) for dtype in KERNEL_TYPES for dim in DECODE_HEAD_DIMS]
    norms = [norm_kernel_name(fused, dtype, w, vec, warps) for dtype in KERNEL_TYPES for w in weights[dtype]
             for fused in (False, True) for vec in (1, 8) for warps in (4, 8)]
    types = [CTYPE[dtype] for dtype in KERNEL_TYPES]
    return {"paged_attention.cu": attn, "layernorm.cu": norms,
            "activation.cu": [f"llmserve::silu_and_mul_kernel<{t}, {vec}>" for t in types for vec in (1, 8)],
            "rotary.cu": [f"llmserve::rotary_kernel<{t}, {i}>" for t in types for i in ("true", "false")],
            "kv_cache.cu": [f"llmserve::write_kv_cache_kernel<{t}, {vec}>" for t in types for vec in (1, 8)],
            "int8_gemv.cu": [int8_gemv_kernel_name(dtype) for dtype in KERNEL_TYPES]}


def kernel_source(filename: str) -> str:
    """A .cu file with common.cuh inlined: NVRTC then needs no include path at all."""
    common = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once", "")
    return (KERNEL_DIR / filename).read_text().replace('#include "common.cuh"', common)
