"""ctypes binding of kquant_linear.c: x [M, K] fp32 @ a GGUF K-type weight [N, K] -> [M, N] fp32.

`pack(parts)` repacks ops/weights/gguf_blocks.Parts of Q2_K..Q6_K losslessly into what the kernel reads:
the codes in bit planes, b bits a weight ([N, P * 8 b] uint8, P = K / 64 pairs of blocks), and the file's
scales per sub-block (S = K/16, or K/32 for Q4_K and Q5_K, whose sub-blocks are 32 weights): d [N, K/256]
fp32 and sc [N, S] int8 by weight row, dmin [K/256, N] fp32 and mn [S, N] int8 by output (the kernel adds
the offsets 8 outputs at a time), except for Q3_K and Q6_K, whose offsets are -zero * scale: the kernel
takes those in the dot products, so they keep no dmin and mn. See the C file for the layout.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.ops.cpu import block_linear, build
from gpu_worker.ops.weights.gguf_blocks import Parts, T

K_BITS = (2, 3, 4, 5, 6)
# the K types whose sub-blocks are 32 weights, a scale and an offset a block
BLOCK_SCALED = (T.Q4_K, T.Q5_K)
# the K types whose offset is -zero * scale (zero 4 and 32, kquant_linear.c's DEFINE_SUB_KIND)
ZERO_CODED = (T.Q3_K, T.Q6_K)
KINDS = tuple(f"k{b}" for b in K_BITS)
_ARGS = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be built."""
    return build.bind("kquant_linear", {f"{kind}_linear_f32": (_ARGS, ctypes.c_int) for kind in KINDS})


@dataclass(frozen=True)
class Packed:
    """A weight as the kernel reads it (the module docstring): `offset` is dmin; it and mn are empty
    for ZERO_CODED types."""

    kind: str
    codes: torch.Tensor
    d: torch.Tensor
    offset: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def pack(parts: Parts) -> Packed:
    """Parts of a K type -> Packed (the legacy types run on cpu/block_linear.py)."""
    if parts.sc is None or parts.mn is None:
        raise ValueError(f"GGUF type {parts.ggml_type.name} runs on the block kernel, not as a K type")
    codes = _torch(block_linear.pack_codes(parts.codes.astype(np.uint8), parts.bits))
    sc, mn, dmin = parts.sc, parts.mn, parts.offset
    if parts.ggml_type in BLOCK_SCALED:  # gguf_blocks stores a 32-weight sub-block's scale twice
        sc, mn = sc[:, ::2], mn[:, ::2]
    if parts.ggml_type in ZERO_CODED:
        mn, dmin = mn[:0, :0], dmin[:0, :0]
    return Packed(f"k{parts.bits}", codes, _torch(parts.d), _torch(dmin.T), _torch(sc), _torch(mn.T))


def linear(x: torch.Tensor, w: Packed, out_features: int) -> torch.Tensor:
    """x: [M, K] fp32 -> [M, N] fp32, N = out_features."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    fn = getattr(library(), f"{w.kind}_linear_f32")
    with build.traced(f"cpu_{w.kind}_linear"):
        rc = fn(x.data_ptr(), w.codes.data_ptr(), w.d.data_ptr(), w.offset.data_ptr(), w.sc.data_ptr(), w.mn.data_ptr(),
                out.data_ptr(), rows, out_features, in_features, block_linear.threads_for(rows, w.codes.numel()))
    if rc != 0:
        raise MemoryError(f"cpu {w.kind} linear: no memory for the {rows} x {in_features} activation codes")
    return out
