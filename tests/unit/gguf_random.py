"""Random GGUF blocks of every quantized type, with finite fp16 scales (helpers for the weight-format tests)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
# byte offsets of each type's fp16 fields (d, and m or dmin) inside its block
FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
               T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(ggml_type: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator,
                  scale: float | None = None) -> np.ndarray:
    """[rows, row bytes] uint8 of random blocks: random codes and sub-scales; each fp16 field a random finite
    fp16 (any exponent) or, with `scale`, uniform in [0, scale) (weights of a usable size)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows * (k // block), size), dtype=np.uint8)
    for at in FP16_FIELDS[ggml_type]:
        if scale is None:
            bits = rng.integers(0, 1 << 16, raw.shape[0], dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0x83FF  # an inf/nan exponent -> exponent 0 (zero or subnormal)
            field = bits.view(np.float16)
        else:
            field = (rng.random(raw.shape[0]) * scale).astype(np.float16)
        raw[:, at:at + 2] = field.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)
