"""GGUF blocks -> codes and scales (ops/weights/gguf_blocks.py) decode to gguf's own values, for every type,
and pack into the C kernels' bit planes without loss (ops/cpu/block_linear.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from gpu_worker.ops.cpu import block_linear
from gpu_worker.ops.weights import gguf_blocks
from tests.unit.gguf_random import random_blocks

T = GGMLQuantizationType


@pytest.mark.parametrize("ggml_type", gguf_blocks.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_every_type_decodes_to_ggufs_values(ggml_type):
    """Random bytes, every fp16 scale a random finite value (subnormals and 65504 included): equal values
    everywhere gguf's are finite (a huge scale times a code may overflow to inf in both; ±0 compare equal)."""
    rng = np.random.default_rng(int(ggml_type))
    raw = random_blocks(ggml_type, 64, 512, rng)
    with np.errstate(over="ignore", invalid="ignore"):
        expect = gguf_dequantize(raw, ggml_type)
        got = gguf_blocks.dequantize(gguf_blocks.parts(ggml_type, raw))
    assert got.shape == expect.shape == (64, 512) and got.dtype == np.float32
    finite = np.isfinite(expect)
    assert finite.mean() > 0.5
    np.testing.assert_array_equal(got[finite], expect[finite])
    assert not np.isfinite(got[~finite]).any()


@pytest.mark.parametrize("ggml_type", gguf_blocks.QUANTIZED_TYPES, ids=lambda t: t.name)
def test_codes_fit_the_types_width(ggml_type):
    rng = np.random.default_rng(1)
    codes = gguf_blocks.parts(ggml_type, random_blocks(ggml_type, 8, 256, rng, scale=1.0)).codes
    low, high = (-128, 127) if ggml_type == T.Q8_0 else (0, 2 ** gguf_blocks.BITS[ggml_type] - 1)
    assert codes.min() == low and codes.max() == high  # random bytes reach both ends


@pytest.mark.parametrize("bits", sorted(block_linear.PLANES))
def test_bit_planes_hold_the_codes(bits):
    """Unpack the planes as the C files' layout comments describe them and get every code back."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, (3, 96), dtype=np.uint8)  # 96: one and a half pairs, zero padded
    packed = block_linear.pack_codes(codes, bits).reshape(3, 2, 8 * bits)
    back = np.zeros((3, 2, 2, 32), dtype=np.uint8)  # row, pair, block, weight
    at = 0
    for plane, shift in block_linear.PLANES[bits]:
        size = {"nibble": 32, "crumb": 16, "bit": 8}[plane]
        part = packed[..., at:at + size].reshape(3, 2, 2, size // 2)
        at += size
        if plane == "nibble":  # byte j: weight j (low nibble), j + 16 (high)
            value = np.concatenate([part & 15, part >> 4], axis=-1)
        elif plane == "crumb":  # byte i: 2 bits of weight 8c + i at bits 2c
            value = np.stack([(part >> (2 * c)) & 3 for c in range(4)], axis=-2).reshape(3, 2, 2, 32)
        else:  # byte c: bit i of weight 8c + i
            value = np.stack([(part >> i) & 1 for i in range(8)], axis=-1).reshape(3, 2, 2, 32)
        back |= value << shift
    assert np.array_equal(back.reshape(3, 128)[:, :96], codes)
    assert not back.reshape(3, 128)[:, 96:].any()
