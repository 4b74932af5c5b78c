"""ctypes binding of kquant_linear.c: x [M, K] fp32 @ a GGUF K-type weight [N, K] -> [M, N] fp32.

`pack(parts)` repacks ops/weights/gguf_blocks.Parts of Q2_K..Q6_K losslessly into what the kernel reads:
the codes in bit planes, b bits a weight ([N, P * 8 b] uint8, P = K / 64 pairs of blocks), and the file's
scales: d and dmin [N, K/256] fp32 with sc and mn [N, K/16] int8. See the C file for the layout.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.ops.cpu import block_linear, build
from gpu_worker.ops.weights.gguf_blocks import Parts

K_BITS = (2, 3, 4, 5, 6)
KINDS = tuple(f"k{b}" for b in K_BITS)
_ARGS = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be built."""
    return build.bind("kquant_linear", {f"{kind}_linear_f32": (_ARGS, ctypes.c_int) for kind in KINDS})


@dataclass(frozen=True)
class Packed:
    """A weight as the kernel reads it (the module docstring); sc and mn None for legacy kinds."""

    kind: str
    codes: torch.Tensor
    d: torch.Tensor
    offset: torch.Tensor
    sc: torch.Tensor | None
    mn: torch.Tensor | None


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def pack(parts: Parts) -> Packed:
    """Parts of a K type -> Packed (the legacy types run on cpu/block_linear.py)."""
    if parts.sc is None or parts.mn is None:
        raise ValueError(f"GGUF type {parts.ggml_type.name} runs on the block kernel, not as a K type")
    codes = _torch(block_linear.pack_codes(parts.codes.astype(np.uint8), parts.bits))
    return Packed(f"k{parts.bits}", codes, _torch(parts.d), _torch(parts.offset), _torch(parts.sc), _torch(parts.mn))


def linear(x: torch.Tensor, w: Packed, out_features: int) -> torch.Tensor:
    """x: [M, K] fp32 -> [M, N] fp32, N = out_features."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    fn = getattr(library(), f"{w.kind}_linear_f32")
    sc, mn = (None, None) if w.sc is None or w.mn is None else (w.sc.data_ptr(), w.mn.data_ptr())
    with build.traced(f"cpu_{w.kind}_linear"):
        rc = fn(x.data_ptr(), w.codes.data_ptr(), w.d.data_ptr(), w.offset.data_ptr(), sc, mn, out.data_ptr(),
                rows, out_features, in_features, block_linear.threads_for(rows, w.codes.numel()))
    if rc != 0:
        raise MemoryError(f"cpu {w.kind} linear: no memory for the {rows} x {in_features} activation codes")
    return out
