"""A GGUF file's GEMM weights -> CPU linears that keep the file's format (`--quantization auto`; the CPU
backend's format FILE_FORMATS, gpu_worker/ops/cpu/backend.py).

    file type                  CPU linear                          kernel
    Q4_0, Q4_1                 Q4_0Weight, Q4_1Weight               ops/cpu/block_linear.c
    Q5_0, Q5_1                 Q5_0Weight, Q5_1Weight               ops/cpu/block_linear.c
    Q8_0                       Q8_0Weight                           ops/cpu/block_linear.c
    Q2_K Q3_K Q4_K Q5_K Q6_K   KQuantWeight (codes in bit planes,   ops/cpu/kquant_linear.c
                               the file's scales)
    F32 F16 BF16               prepacked fp32 (ops/weights/packed_linear.py)

Every conversion is lossless (ops/weights/gguf_blocks.py) and goes from the file's bytes straight to
the kernel's layout, with no float copy of a quantized weight. A fused weight (Q, K and V; gate and
up) whose parts share a type is one weight of their rows; a K-quant mix gives parts of different
types (llama-quantize's Q4_K_M stores some V projections in Q6_K or Q8_0, and a width that is not a
multiple of 256 in a legacy type): each run of parts of one type is one weight, and the runs one
`RowsWeight` (a Q5_0 Q and K, then a Q8_0 V: two kernel calls).

Q5_0 ran as Q8_0 (8.5 bits a weight), then as Q5_1 with m = -16 d (6 bits), before the block kernels
took its offset inside the dot products (5.5 bits, its file's; docs/models.md has the figures).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from gpu_worker.ops.cpu import block_linear, kquant_linear
from gpu_worker.ops.weights import gguf_blocks, packed_linear
from gpu_worker.ops.weights.quantized_linear import (
    KQuantWeight,
    Q4_0Weight,
    Q4_1Weight,
    Q5_0Weight,
    Q5_1Weight,
    Q8_0Weight,
    QuantizedWeight,
)

T = GGMLQuantizationType
SUPPORTED_TYPES = gguf_blocks.FLOAT_TYPES + gguf_blocks.QUANTIZED_TYPES
BLOCK_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # what block_linear.c runs
FILE_FORMATS = "gguf"  # the CPU backend's weight format for weights kept as the file has them


def supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)


@dataclass(frozen=True)
class FileTensor:
    """A GEMM weight [N, K] as a GGUF file stores it: data [N, row bytes] uint8 for a quantized type,
    [N, K] for a float one (rows outermost); a row permutation of it is still the file's format."""

    ggml_type: GGMLQuantizationType
    data: np.ndarray
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def quantized(self) -> bool:
        return self.ggml_type in gguf_blocks.QUANTIZED_TYPES

    def rows(self, index: np.ndarray) -> FileTensor:
        """The tensor of rows `index` (a permutation or selection), in the same format."""
        return FileTensor(self.ggml_type, self.data[index], self.in_features)

    def dequantize(self) -> torch.Tensor:
        """-> [N, K] fp32, gguf's own values."""
        w = gguf_dequantize(self.data, self.ggml_type).reshape(self.out_features, self.in_features)
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


def _stacked(parts: list[FileTensor]) -> FileTensor:
    return FileTensor(parts[0].ggml_type, np.concatenate([p.data for p in parts]), parts[0].in_features)


def _single(t: FileTensor) -> QuantizedWeight | nn.Parameter:
    """One tensor's CPU linear."""
    n, k = t.out_features, t.in_features
    if not t.quantized:
        return nn.Parameter(packed_linear.pack(t.dequantize()), requires_grad=False)
    parts = gguf_blocks.parts(t.ggml_type, t.data)
    if t.ggml_type not in BLOCK_TYPES:
        return KQuantWeight(kquant_linear.pack(parts), n, k)
    codes = torch.from_numpy(parts.codes).view(n, -1, block_linear.BLOCK)  # [N, G, 32]
    d, offset = torch.from_numpy(parts.d), torch.from_numpy(parts.offset)
    if t.ggml_type == T.Q4_0:
        return Q4_0Weight.from_packed(block_linear.pack_q4_1(codes, d, None), n, k)
    if t.ggml_type == T.Q4_1:
        return Q4_1Weight.from_packed(block_linear.pack_q4_1(codes, d, offset), n, k)
    if t.ggml_type == T.Q5_0:
        return Q5_0Weight.from_packed(block_linear.pack_q5_1(codes, d, None), n, k)
    if t.ggml_type == T.Q5_1:
        return Q5_1Weight.from_packed(block_linear.pack_q5_1(codes, d, offset), n, k)
    return Q8_0Weight.from_packed(block_linear.pack_q8_0(codes, d), n, k)


class RowsWeight(QuantizedWeight):
    """One fused weight [N, K] as row blocks in different formats: out = cat of each block's output."""

    def __init__(self, parts: list[QuantizedWeight | nn.Parameter], out_features: list[int], in_features: int) -> None:
        """out_features: each part's rows, in order."""
        super().__init__()
        self.parts = parts  # not registered: a prepacked parameter is no module; the model is inference-only
        self.part_rows = out_features
        self.out_features, self.in_features = sum(out_features), in_features

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, K] -> [T, N]"""
        out = torch.cat([packed_linear.linear(x, p) for p in self.parts], dim=-1)
        return out if bias is None else out + bias

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, QuantizedWeight) else p.numel() * p.element_size() for p in self.parts)


def cpu_weight(parts: list[FileTensor]) -> QuantizedWeight | nn.Parameter:
    """The row blocks of one (fused) weight, in order -> its CPU linear in the file's format(s): each run
    of parts of one type as one weight of their rows, several runs as a RowsWeight of them."""
    runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.ggml_type)]
    weights = [_single(_stacked(run)) for run in runs]
    if len(weights) == 1:
        return weights[0]
    return RowsWeight(weights, [sum(p.out_features for p in run) for run in runs], parts[0].in_features)
