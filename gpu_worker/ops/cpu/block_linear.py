"""ctypes binding of block_linear.c: x [M, K] fp32 @ a block-quantized weight [N, K] -> [M, N] fp32.

A weight is N rows of K/32 blocks, padded to whole pairs of blocks: codes [N, P * pair bytes]
(Q4_0 and Q4_1: 4-bit, 32 bytes a pair; Q5_0 and Q5_1: 5-bit in a nibble and a bit plane, 40 bytes;
Q8_0: int8, 64 bytes; each in the order the kernel reads them), fp16 scales d [N, 2P] and, for Q4_1 and
Q5_1, fp16 offsets m [2P, N] (a column a row: the kernel adds their terms 8 outputs at a time; Q4_0's
and Q5_0's offsets, -8 d and -16 d, it takes inside the dot products). They are read in place and
multiplied as integers against 8-bit codes of the activations (16-bit for Q8_0 without VNNI). See the
C file for the layout, for that choice and for why a row's output is the same bits for any number of
rows and threads.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from gpu_worker.ops.cpu import build

BLOCK = 32
KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
# bit planes per code width, low bits first: (plane, shift); nibble 4 bits, crumb 2, bit 1
PLANES = {2: (("crumb", 0),), 3: (("crumb", 0), ("bit", 2)), 4: (("nibble", 0),), 5: (("nibble", 0), ("bit", 4)),
          6: (("nibble", 0), ("crumb", 4))}
_ARGS = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
# Up to this many rows a call runs on one thread. A one-sequence decode step is the shortest there is,
# and the other core is busy meanwhile with that token's work in the worker's event loop, Valkey and
# the gateway, so a second kernel thread mostly waits for it: faster in-process, no faster through the
# stack (docs/performance.md, "Figures behind the CPU kernels' settings").
SINGLE_THREAD_ROWS = 1
# ... unless the call reads more weight than this: a vocabulary head (SmolLM2's Q8_0 head is 30 MB,
# 1.1 ms a row on one thread) is long enough for a second thread to pay for its wait.
SPLIT_WEIGHT_BYTES = 8 << 20


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be built (no compiler, no AVX2/FMA/F16C)."""
    return build.bind("block_linear", {f"{kind}_linear_f32": (_ARGS, ctypes.c_int) for kind in KINDS})


def threads_for(rows: int, weight_bytes: int = 0) -> int:
    """Threads for a kernel call over `rows` activation rows and `weight_bytes` of weights: one up to
    SINGLE_THREAD_ROWS below SPLIT_WEIGHT_BYTES, else torch's. A row's output does not depend on the
    thread count, so neither do the logits."""
    return 1 if rows <= SINGLE_THREAD_ROWS and weight_bytes < SPLIT_WEIGHT_BYTES else torch.get_num_threads()


def linear(kind: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """x: [M, K] fp32, codes: [N, P * pair bytes] uint8, scales: [N, 2P] fp16, offsets: [2P, N] fp16
    (q4_1, q5_1) or None (q4_0, q5_0, q8_0) -> [M, N] fp32."""
    if not x.is_contiguous():
        x = x.contiguous()
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    fn = getattr(library(), f"{kind}_linear_f32")
    with build.traced(f"cpu_{kind}_linear"):
        rc = fn(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                out.data_ptr(), rows, out_features, in_features, threads_for(rows, codes.numel()))
    if rc != 0:
        raise MemoryError(f"cpu {kind} linear: no memory for the {rows} x {in_features} activation codes")
    return out


def _pad_to_pairs(t: torch.Tensor) -> torch.Tensor:
    """[N, G, ...] per block -> [N, 2P, ...], P = ceil(G / 2): an odd last block gets an all-zero partner."""
    if t.shape[1] % 2 == 0:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], 1, *t.shape[2:])], dim=1)


Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # what `linear` takes: codes, scales, offsets

def pack_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Packed:
    """codes [N, G, 32] in 0..15, d and m [N, G] -> (codes [N, P * 32] uint8, d [N, 2P] and m [2P, N] fp16):
    per pair, block A's 16 bytes then B's, byte j holding code j | code j+16 << 4 (a GGUF Q4_1 block's code
    bytes). m None: Q4_0's codes (w = (code - 8) d), no offsets."""
    codes = _pad_to_pairs(codes.to(torch.uint8))
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # [N, 2P, 16]
    return nibbles.flatten(1).contiguous(), _pad_to_pairs(d).to(torch.float16).contiguous(), _offsets(m)


def _offsets(m: torch.Tensor | None) -> torch.Tensor | None:
    """m [N, G] -> [2P, N] fp16, the kernel's layout."""
    return None if m is None else _pad_to_pairs(m).to(torch.float16).t().contiguous()


def pack_q8_0(codes: torch.Tensor, d: torch.Tensor) -> Packed:
    """codes [N, G, 32] in -127..127, d [N, G] -> (codes [N, P * 64] uint8, d [N, 2P] fp16, None): per pair,
    four 16-byte chunks [A 8c..8c+7, B 8c..8c+7] of int8 codes."""
    paired = _pad_to_pairs(codes.to(torch.int8)).view(codes.shape[0], -1, 2, 4, 8).transpose(2, 3)  # [N, P, c, A|B, 8]
    paired = paired.contiguous().view(torch.uint8)
    return paired.flatten(1).contiguous(), _pad_to_pairs(d).to(torch.float16).contiguous(), None


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


def pack_q5_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> Packed:
    """codes [N, G, 32] in 0..31, d and m [N, G] -> (codes [N, P * 40] uint8: per pair the nibble plane,
    then the bit plane, d [N, 2P] and m [2P, N] fp16). m None: Q5_0's codes (w = (code - 16) d)."""
    planes = pack_codes(codes.flatten(1).to(torch.uint8).numpy(), 5)
    return torch.from_numpy(planes), _pad_to_pairs(d).to(torch.float16).contiguous(), _offsets(m)
