"""Weight-only quantized linears: the weights stay int8 / int4 in memory and in the GEMM.

A decode step of a small model reads every weight once, so its time is mostly memory traffic:
SmolLM2-135M's 30 layers are 424 MB in fp32, 106 MB in int8 and 60 MB in int4 (scales included).
Both formats run on kernels torch ships for the CPU, which dequantize inside the GEMM:

    format  weight                                    kernel
    int8    q [N, K] int8, scale [N] (per row)        aten._weight_int8pack_mm
    int4    q 4-bit in groups of 32 along K,          aten._weight_int4pack_mm_for_cpu
            scale, zero [K/32, N] (GGUF Q4_1 blocks)

The activations enter those kernels in bf16: it is the dtype they vectorise on an AVX2 CPU
(fp32 activations fall to a scalar loop 3-10x slower; measured on SmolLM2's shapes). Everything
around the GEMMs (residual stream, norms, attention, KV cache) stays fp32.

int4 uses the GGUF's own block layout (32 weights, one scale and one offset): requantizing a
Q4_1-dequantized weight with min/max per group of 32 gets back its 4-bit codes, so only the
scale and offset round (to bf16, the dtype the kernel takes them in).

Every row of the output depends only on its own input row, computed the same bits for any
number of rows (tests/unit/test_quantized_linear.py), so a sequence's logits do not depend
on what it is batched with, as with the prepacked fp32 path.

On CUDA, int8 has the same weight (`CudaInt8Weight`: q [N, K] int8, scale [N] fp32) and runs
in the activations' dtype: decode-sized calls on a CuPy kernel that reads the int8 rows and
widens them in registers (gpu_worker/kernels/int8_gemv.cu), prefill-sized ones dequantize
and use cuBLAS (gpu_worker.ops.cuda.int8_linear). A decode batch's rows are the same bits for
any batch of up to INT8_GEMV_MAX_TOKENS sequences; a larger decode batch takes the cuBLAS path,
so batch invariance on CUDA int8 holds up to that size (quantization is off by default).
"""

from __future__ import annotations

import torch
from torch import nn

ACT_DTYPE = torch.bfloat16
INT4_GROUP = 32
_INT4_INNER_K_TILES = 2  # the packed layout's K tiling; K must be a multiple of 16 * this


class QuantizedWeight(nn.Module):
    """A linear weight [N, K] in a quantized format; `self(x, bias)` is F.linear(x, W, bias)."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, K] fp32 -> [T, N] in x.dtype."""
        out = self.matmul(x.to(ACT_DTYPE)).to(x.dtype)
        return out if bias is None else out + bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K] bf16 -> [T, N] bf16."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight [N, K] ~ q[n, k] * scale[n]; returns (q int8, scale fp32)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Weight(QuantizedWeight):
    """Symmetric per-output-channel int8: W[n, k] ~ q[n, k] * scale[n]."""

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float."""
        super().__init__()
        q, scale = int8_per_channel(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)  # [N, K]
        self.register_buffer("scale", scale.to(ACT_DTYPE))  # [N]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


class Int4Weight(QuantizedWeight):
    """Asymmetric int4 in groups of 32 along K: W[n, k] ~ (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // 32."""

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float, K a multiple of 32."""
        super().__init__()
        n, k = weight.shape
        if k % (16 * _INT4_INNER_K_TILES) or k % INT4_GROUP:
            raise ValueError(f"int4 needs in_features to be a multiple of 32, not {k}")
        groups = weight.detach().float().view(n, k // INT4_GROUP, INT4_GROUP)  # [N, K/32, 32]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/32]
        scale = ((high - low) / 15).clamp(min=1e-12)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        self.out_features, self.in_features = n, k
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INT4_INNER_K_TILES))
        # [K/32, N, 2]: the kernel's (scale, zero) pairs; zero is the value of code 8
        pairs = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1)
        self.register_buffer("scale_zero", pairs.contiguous().to(ACT_DTYPE))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zero)


class CudaInt8Weight(QuantizedWeight):
    """Int8Weight's format on CUDA, in the activations' dtype (see the module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float, on the GPU."""
        super().__init__()
        q, scale = int8_per_channel(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)  # [N, K]
        self.register_buffer("scale", scale)  # [N] fp32

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from gpu_worker.ops import cuda  # CuPy: imported only where a GPU model runs

        out = cuda.int8_linear(x, self.q, self.scale)
        return out if bias is None else out + bias


FORMATS: dict[str, type[QuantizedWeight]] = {"int8": Int8Weight, "int4": Int4Weight}
CUDA_FORMATS: dict[str, type[QuantizedWeight]] = {"int8": CudaInt8Weight}


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """A float weight [N, K] -> the same linear in format `fmt` (a key of FORMATS)."""
    return FORMATS[fmt](weight)
