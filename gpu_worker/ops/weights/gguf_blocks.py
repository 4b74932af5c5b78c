"""GGUF quantized blocks -> integer codes and the scales that decode them, losslessly.

Every quantized GGUF type this serves decodes as w = scale * code + offset, with a small unsigned
(or, for Q8_0, signed) integer code per weight and a scale and offset per sub-block:

    type   bits  sub-block  scale               offset               file bytes / weight
    Q4_0   4     32         d                   -8 d                 4.5 / 8
    Q4_1   4     32         d                   m                    5.0 / 8
    Q5_0   5     32         d                   -16 d                5.5 / 8
    Q5_1   5     32         d                   m                    6.0 / 8
    Q8_0   8     32         d (signed codes)    0                    8.5 / 8
    Q2_K   2     16         d * sc (4 bit)      -dmin * m (4 bit)    2.625 / 8
    Q3_K   3     16         d * (sc - 32)       -4 d * (sc - 32)     3.4375 / 8
    Q4_K   4     32         d * sc (6 bit)      -dmin * m (6 bit)    4.5 / 8
    Q5_K   5     32         d * sc (6 bit)      -dmin * m (6 bit)    5.5 / 8
    Q6_K   6     16         d * sc (int8)       -32 d * sc           6.5625 / 8

d, dmin and m are the file's fp16 values. The K types (super-blocks of 256) keep their two levels:
fp32 `d` and `dmin` (the offsets' factor, sign folded in) per super-block and int8 `sc` and `mn` per
16 weights; the legacy types (blocks of 32) keep `d` and `offset` per block in fp32. Every product
above is exact in fp32 (an fp16 significand of 11 bits times integers of at most 8 and 6 bits), so
`dequantize(parts)` = fl(scale * code + offset) equals `gguf.quants.dequantize` bit for bit
(tests/unit/test_gguf_blocks.py checks every type over random blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
SUPER = 256  # weights in a K-type super-block
SUB = 16  # weights per K-type sub-scale as stored (a 32-weight sub-block's scale is stored twice)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
LEGACY_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
QUANTIZED_TYPES = LEGACY_TYPES + K_TYPES
ZERO_CODES = {T.Q4_0: 8, T.Q5_0: 16}  # the code of a zero weight: offset = -zero * d
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8,
        T.Q2_K: 2, T.Q3_K: 3, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}


@dataclass(frozen=True)
class Parts:
    """A weight [N, K] as codes and scales; w = scale * code + offset per sub-block (module docstring).

    Legacy types: d and offset [N, K/32] fp32, sc and mn None.
    K types: d and offset (dmin, sign folded in) [N, K/256] fp32; sc and mn [N, K/16] int8, so
    scale = d * sc and offset = dmin * mn.
    """

    ggml_type: GGMLQuantizationType
    codes: np.ndarray  # [N, K] int16
    d: np.ndarray
    offset: np.ndarray
    sc: np.ndarray | None = None
    mn: np.ndarray | None = None

    @property
    def bits(self) -> int:
        return BITS[self.ggml_type]

    def scales(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, offset) per sub-block: [N, K/32] (legacy) or [N, K/16] (K types), fp32."""
        if self.sc is None or self.mn is None:
            return self.d, self.offset
        per = SUPER // SUB
        d, dmin = np.repeat(self.d, per, axis=1), np.repeat(self.offset, per, axis=1)
        return d * self.sc.astype(np.float32), dmin * self.mn.astype(np.float32)


def dequantize(parts: Parts) -> np.ndarray:
    """Parts -> the weight [N, K] fp32, fl(scale * code + offset): gguf's own values."""
    scale, offset = parts.scales()
    n, k = parts.codes.shape
    size = k // scale.shape[1]
    codes = parts.codes.reshape(n, -1, size).astype(np.float32)
    return (scale[..., None] * codes + offset[..., None]).reshape(n, k)


def row_bytes(ggml_type: GGMLQuantizationType, k: int) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return k // block * size


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] fp32 (an fp16 widens exactly)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] bytes -> [nb, 32] codes: byte j holds code j (low nibble) and j + 16 (high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[nb, 4] bytes (a little-endian uint32) -> [nb, 32] bits, bit i for code i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _legacy(ggml_type: GGMLQuantizationType, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[nb, type size] blocks of 32 -> (codes [nb, 32], d [nb], offset [nb])."""
    d = _f16(blocks[:, 0:2])
    if ggml_type == T.Q8_0:
        return blocks[:, 2:].view(np.int8).astype(np.int16), d, np.zeros_like(d)
    if ggml_type == T.Q4_0:
        return _nibbles(blocks[:, 2:]), d, -ZERO_CODES[T.Q4_0] * d
    if ggml_type == T.Q4_1:
        return _nibbles(blocks[:, 4:]), d, _f16(blocks[:, 2:4])
    if ggml_type == T.Q5_0:
        return _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4), d, -ZERO_CODES[T.Q5_0] * d
    return _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4), d, _f16(blocks[:, 2:4])  # Q5_1


def _shifted(q: np.ndarray, shifts: list[int], mask: int, run: int) -> np.ndarray:
    """Bit fields of bytes: q [nb, groups * run] -> [nb, groups * len(shifts) * run], field s of byte j of
    group g at g * len(shifts) * run + s * run + j (how the K types lay out their low bits)."""
    nb = q.shape[0]
    fields = q.reshape(nb, -1, 1, run) >> np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return (fields & np.uint8(mask)).reshape(nb, -1)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 6-bit (sc, m) [nb, 8] each (llama.cpp's get_scale_min_k4)."""
    q = scales.reshape(-1, 12)
    d, m, hi = q[:, 0:4], q[:, 4:8], q[:, 8:12]
    sc = np.concatenate([d & 63, (hi & 15) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (hi >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _k_quant(ggml_type: GGMLQuantizationType, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """[nb, type size] super-blocks -> (codes [nb, 256], d [nb], dmin [nb], sc [nb, 16], mn [nb, 16])."""
    if ggml_type == T.Q2_K:
        scales, qs = b[:, :16], b[:, 16:80]
        d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
        return _shifted(qs, [0, 2, 4, 6], 3, 32), d, -dmin, scales & 15, scales >> 4
    if ggml_type == T.Q3_K:
        hmask, qs, raw, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
        low = _shifted(raw[:, :8], [0, 4], 15, 8)  # [nb, 16]
        high = _shifted(raw[:, 8:12], [0, 2, 4, 6], 3, 4)
        sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
        codes = _shifted(qs, [0, 2, 4, 6], 3, 32) | (_shifted(hmask, list(range(8)), 1, 32) << 2)
        return codes, d, -4 * d, sc, sc
    if ggml_type in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _scale_min_k4(b[:, 4:16])
        codes = _shifted(b[:, -128:], [0, 4], 15, 32)
        if ggml_type == T.Q5_K:
            codes = codes | (_shifted(b[:, 16:48], list(range(8)), 1, 32) << 4)
        return codes, d, -dmin, np.repeat(sc, 2, axis=1), np.repeat(mn, 2, axis=1)
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])  # Q6_K
    codes = _shifted(ql, [0, 4], 15, 64) | (_shifted(qh, [0, 2, 4, 6], 3, 32) << 4)
    return codes, d, -32 * d, sc, sc


def parts(ggml_type: GGMLQuantizationType, raw: np.ndarray) -> Parts:
    """A quantized tensor's bytes [N, row bytes] (rows outermost, as GGUFReader gives them) -> Parts."""
    n = raw.shape[0]
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    if ggml_type in LEGACY_TYPES:
        codes, d, offset = _legacy(ggml_type, blocks)
        return Parts(ggml_type, codes.astype(np.int16).reshape(n, -1), d.reshape(n, -1), offset.reshape(n, -1))
    if ggml_type not in K_TYPES:
        raise ValueError(f"GGUF type {ggml_type.name} has no block codes")
    codes, d, dmin, sc, mn = _k_quant(ggml_type, blocks)
    return Parts(ggml_type, codes.astype(np.int16).reshape(n, -1), d.reshape(n, -1), dmin.reshape(n, -1),
                 sc.astype(np.int8).reshape(n, -1), mn.astype(np.int8).reshape(n, -1))
