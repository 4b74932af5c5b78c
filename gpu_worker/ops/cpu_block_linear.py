"""ctypes binding of cpu_block_linear.c: x [M, K] fp32 @ a block-quantized weight [N, K] -> [M, N] fp32.

A weight is N rows of K/32 blocks (Q4_1: fp16 d and 16 bytes of 4-bit codes, with the blocks'
offsets m in a separate fp32 array [N, K/32]; Q8_0: fp16 d and 32 int8 codes), read in place
and multiplied as integers against 16-bit codes of the activations. See the C file for the
layout and for why a row's output is the same bits for any number of rows and threads.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from gpu_worker.ops import cpu_kernels

BLOCK = 32
KINDS = ("q4_1", "q8_0")
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be built (no compiler, no AVX2/FMA/F16C)."""
    return cpu_kernels.bind("cpu_block_linear", {f"{kind}_linear_f32": (_ARGS, ctypes.c_int) for kind in KINDS})


def linear(kind: str, x: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """x: [M, K] fp32, blocks: [N, K/32 * block bytes] uint8, offsets: [N, K/32] fp32 (q4_1) or None
    -> [M, N] fp32."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    fn = getattr(library(), f"{kind}_linear_f32")
    with cpu_kernels.traced(f"cpu_{kind}_linear"):
        rc = fn(x.data_ptr(), blocks.data_ptr(), None if offsets is None else offsets.data_ptr(), out.data_ptr(),
                rows, out_features, in_features, torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"cpu {kind} linear: no memory for the {rows} x {in_features} activation codes")
    return out


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, G] float -> [N, G, 2] uint8: each value as little-endian fp16."""
    return t.to(torch.float16).contiguous().view(torch.uint8).view(*t.shape, 2)


def pack_q4_1(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """codes [N, G, 32] in 0..15, d [N, G] -> blocks [N, G * 18] uint8 (fp16 d; byte j: code j | code j+16 << 4)."""
    codes = codes.to(torch.uint8)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # [N, G, 16]
    return torch.cat([_fp16_bytes(d), nibbles], dim=-1).flatten(1).contiguous()


def pack_q8_0(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """codes [N, G, 32] in -127..127, d [N, G] -> blocks [N, G * 34] uint8 (fp16 d, int8 codes)."""
    return torch.cat([_fp16_bytes(d), codes.to(torch.int8).view(torch.uint8)], dim=-1).flatten(1).contiguous()
