"""ctypes binding of kquant_linear.c: x [M, K] fp32 @ a 2- to 6-bit GGUF weight [N, K] -> [M, N] fp32.

`pack(parts)` repacks ops/weights/gguf_blocks.Parts losslessly into what the kernel reads: the codes in bit
planes, b bits a weight ([N, P * 8 b] uint8, P = ceil(K / 64) pairs of blocks), and the file's
scales: Q5_1 the file's fp16 d and m [N, 2P] (Q4_0 and Q5_0 run as Q4_1 and Q8_0 on block_linear.c,
ops/weights/gguf_weight.py); K types d and dmin [N, K/256] fp32 with sc and mn [N, K/16] int8. So a
Q5_1 weight takes the file's own bytes. See the C file for the layout.
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
KINDS = ("legacy5", *(f"k{b}" for b in K_BITS))  # Q5_1, then the K types
_ARGS = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 4
# bit planes per code width, low bits first: (plane, shift); nibble 4 bits, crumb 2, bit 1
PLANES = {2: (("crumb", 0),), 3: (("crumb", 0), ("bit", 2)), 4: (("nibble", 0),), 5: (("nibble", 0), ("bit", 4)),
          6: (("nibble", 0), ("crumb", 4))}


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


def _plane(codes: np.ndarray, plane: str) -> np.ndarray:
    """codes [N, P, 2, 32] (pair, block, weight) of the plane's bits -> [N, P, plane bytes]."""
    n, p = codes.shape[:2]
    if plane == "nibble":
        return (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, p, 32)
    by_chunk = codes.reshape(n, p, 2, 4, 8)  # [.., block, chunk c, i]: weight 8c + i
    if plane == "crumb":
        return np.bitwise_or.reduce([by_chunk[..., c, :] << (2 * c) for c in range(4)]).reshape(n, p, 16)
    return np.bitwise_or.reduce([by_chunk[..., i] << i for i in range(8)]).reshape(n, p, 8)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [N, K] in 0..2^bits - 1 -> [N, P * 8 bits] uint8 bit planes (K padded with zeros to 64 P)."""
    n, k = codes.shape
    pairs = -(-k // 64)
    padded = np.zeros((n, pairs * 64), dtype=np.uint8)
    padded[:, :k] = codes
    by_pair = padded.reshape(n, pairs, 2, 32)
    planes = [_plane((by_pair >> shift) & {"nibble": 15, "crumb": 3, "bit": 1}[plane], plane)
              for plane, shift in PLANES[bits]]
    return np.concatenate(planes, axis=-1).astype(np.uint8).reshape(n, -1)


def _pad_blocks(t: np.ndarray) -> np.ndarray:
    """[N, G] per block -> [N, 2P]: an odd last block gets a zero partner."""
    return t if t.shape[1] % 2 == 0 else np.pad(t, ((0, 0), (0, 1)))


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def pack(parts: Parts) -> Packed:
    """Parts of Q5_1 or a K type -> Packed (the other legacy types run on cpu/block_linear.py)."""
    codes = _torch(pack_codes(parts.codes.astype(np.uint8), parts.bits))
    if parts.sc is not None and parts.mn is not None:   # the K types: sub-block scales and mins
        return Packed(f"k{parts.bits}", codes, _torch(parts.d), _torch(parts.offset), _torch(parts.sc),
                      _torch(parts.mn))
    if parts.ggml_type != T.Q5_1:
        raise ValueError(f"GGUF type {parts.ggml_type.name} runs on the block kernel, not in bit planes")
    d = _torch(_pad_blocks(parts.d).astype(np.float16))  # the file's fp16 d and m, exactly
    return Packed("legacy5", codes, d, _torch(_pad_blocks(parts.offset).astype(np.float16)), None, None)


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
                rows, out_features, in_features, block_linear.threads_for(rows))
    if rc != 0:
        raise MemoryError(f"cpu {w.kind} linear: no memory for the {rows} x {in_features} activation codes")
    return out
