"""Weight-only quantized linears: the weights stay int8 / int4 in memory and in the GEMM.

A decode step of a small model reads every weight once, so its time is mostly memory traffic:
SmolLM2-135M's 30 layers are 424 MB in fp32, 106 MB in int8 and 73 MB in int4 (scales included).

    format  weight                                    kernel
    int8    q [N, K] int8, scale [N] (per row)        aten._weight_int8pack_mm (bf16 activations)
    int4    GGUF Q4_1 blocks: 4-bit codes in groups   the C kernel of ops/cpu/block_linear.py
            of 32 along K, fp16 scale, fp32 offset    (8-bit activation codes, fp32 out), else
                                                      aten._weight_int4pack_mm_for_cpu (bf16)
    (head)  GGUF Q8_0 blocks beside int4              the same C kernel

Requantizing a Q4_1-dequantized weight with min/max per group of 32 gets back its 4-bit codes,
and a Q8_0-dequantized one with max |w| per group its int8 codes: a GGUF file's weights come
back exactly. torch's kernels take bf16 activations (what they vectorise on an AVX2 CPU); the C
kernel rounds them to 8-bit codes per block of 32 for Q4_1, as llama.cpp does, and keeps ~5 digits
for the Q8_0 head (perplexity within 1 % of llama.cpp's on the same file, docs/models.md). Everything
around the GEMMs (residual stream, norms, attention, KV cache) stays fp32.

Every row of the output depends only on its own input row, computed the same bits for any
number of rows (tests/unit/test_quantized_linear.py), so a sequence's logits do not depend
on what it is batched with, as with the prepacked fp32 path.

On CUDA, int8 has the same weight (`CudaInt8Weight`: q [N, K] int8, scale [N] fp32) and runs
in the activations' dtype: decode-sized calls on a CuPy kernel that reads the int8 rows and
widens them in registers (gpu_worker/ops/cuda/int8_gemv.cu), prefill-sized ones dequantize
and use cuBLAS (gpu_worker.ops.cuda.ops.int8_linear). A decode batch's rows are the same bits for
any batch of up to INT8_GEMV_MAX_TOKENS sequences; a larger decode batch takes the cuBLAS path,
so batch invariance on CUDA int8 holds up to that size (`--quantization auto` leaves CUDA weights as they are).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.ops.cpu import block_linear, kquant_linear

ACT_DTYPE = torch.bfloat16
GROUP = block_linear.BLOCK  # weights per quantization group along K (a GGUF block)
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


def _groups(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """weight [N, K] -> fp32 [N, K/32, 32]; K must be a multiple of GROUP."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"{fmt} needs in_features to be a multiple of {GROUP}, not {k}")
    return weight.detach().float().view(n, k // GROUP, GROUP)


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit in groups of 32 along K (GGUF Q4_1): weight [N, K] ~ codes * scale + low per group;
    returns (codes [N, K/32, 32] int32 in 0..15, scale [N, K/32], low [N, K/32])."""
    groups = _groups(weight, "int4")  # [N, K/32, 32]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/32]
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes, scale, low


class Int4Weight(QuantizedWeight):
    """int4_groups on torch's kernel: W[n, k] ~ (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // 32."""

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float, K a multiple of 32."""
        super().__init__()
        n, k = weight.shape
        if k % (16 * _INT4_INNER_K_TILES):
            raise ValueError(f"int4 needs in_features to be a multiple of {16 * _INT4_INNER_K_TILES}, not {k}")
        codes, scale, low = int4_groups(weight)
        self.out_features, self.in_features = n, k
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(n, k), _INT4_INNER_K_TILES)
        self.register_buffer("packed", packed)
        # [K/32, N, 2]: the kernel's (scale, zero) pairs; zero is the value of code 8
        pairs = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1)
        self.register_buffer("scale_zero", pairs.contiguous().to(ACT_DTYPE))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)


class BlockWeight(QuantizedWeight):
    """A weight in blocks of 32 on the C kernel (ops/cpu/block_linear.py), fp32 in and out."""

    kind: str
    codes: torch.Tensor     # buffers, registered in __init__
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(self, packed: block_linear.Packed, out_features: int, in_features: int) -> None:
        """packed: (codes, scales, offsets) as block_linear.pack_* gives them."""
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        codes, scales, offsets = packed
        self.register_buffer("codes", codes)  # [N, P * pair bytes] uint8
        self.register_buffer("scales", scales)  # [N, 2P] fp16
        self.register_buffer("offsets", offsets)  # [2P, N] fp16 or None

    @classmethod
    def from_packed(cls, packed: block_linear.Packed, out_features: int, in_features: int) -> BlockWeight:
        """The weight of a GGUF file's own blocks, packed by block_linear.pack_* (no float weight to quantize)."""
        weight = cls.__new__(cls)
        BlockWeight.__init__(weight, packed, out_features, in_features)
        return weight

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = block_linear.linear(self.kind, x.float(), self.codes, self.scales, self.offsets, self.out_features)
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if bias is None else out + bias


class Q4_1Weight(BlockWeight):
    """int4_groups as GGUF Q4_1 blocks (fp16 scale and offset): a Q4_1 file's weights come back exactly."""

    kind = "q4_1"

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float, K a multiple of 32."""
        codes, scale, low = int4_groups(weight)
        super().__init__(block_linear.pack_q4_1(codes, scale, low), *weight.shape)


class Q4_0Weight(BlockWeight):
    """A GGUF Q4_0 file's weight: 4-bit codes in groups of 32, fp16 scale, w = (code - 8) * d."""

    kind = "q4_0"


class Q5_1Weight(BlockWeight):
    """A GGUF Q5_1 file's weight: 5-bit codes in groups of 32, fp16 scale and offset."""

    kind = "q5_1"


class Q5_0Weight(BlockWeight):
    """A GGUF Q5_0 file's weight: 5-bit codes in groups of 32, fp16 scale, w = (code - 16) * d."""

    kind = "q5_0"


class Q8_0Weight(BlockWeight):
    """Symmetric int8 in groups of 32 along K (GGUF Q8_0): W ~ code * d per group (a Q8_0 file's exactly)."""

    kind = "q8_0"

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float, K a multiple of 32."""
        groups = _groups(weight, "q8_0")  # [N, K/32, 32]
        d = (groups.abs().amax(dim=-1) / 127).clamp(min=1e-12)  # [N, K/32]
        codes = torch.round(groups / d[..., None]).clamp(-127, 127)
        super().__init__(block_linear.pack_q8_0(codes, d), *weight.shape)


class KQuantWeight(QuantizedWeight):
    """A GGUF K-type weight (Q2_K..Q6_K) in its file's codes and scales, on the C kernel of
    ops/cpu/kquant_linear.py, fp32 in and out."""

    def __init__(self, packed: kquant_linear.Packed, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.packed = packed
        for name in ("codes", "d", "offset", "sc", "mn"):  # as buffers: nbytes counts them
            self.register_buffer(name, getattr(packed, name))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = kquant_linear.linear(x.float(), self.packed, self.out_features)
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        return out if bias is None else out + bias


class CudaInt8Weight(QuantizedWeight):
    q: torch.Tensor         # buffers, registered in __init__
    scale: torch.Tensor

    """Int8Weight's format on CUDA, in the activations' dtype (see the module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [N, K] float, on the GPU."""
        super().__init__()
        q, scale = int8_per_channel(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)  # [N, K]
        self.register_buffer("scale", scale)  # [N] fp32

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from gpu_worker.ops.cuda import ops as cuda  # CuPy: imported only where a GPU model runs

        out = cuda.int8_linear(x, self.q, self.scale)
        return out if bias is None else out + bias


FORMATS: dict[str, type[QuantizedWeight]] = {"int8": Int8Weight, "int4": Int4Weight}
CUDA_FORMATS: dict[str, type[QuantizedWeight]] = {"int8": CudaInt8Weight}


def default_format(device: torch.device, in_features: list[int]) -> str:
    """What --quantization auto means for a model whose GEMMs take `in_features`: int4 on the CPU where
    the block kernel builds and every width is a multiple of 32 (the fastest CPU format, README), else none."""
    if device.type == "cpu" and block_linear.library() is not None and all(
            k % GROUP == 0 for k in in_features):
        return "int4"
    return "none"


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """A float CPU weight [N, K] -> the same linear in format `fmt` (a key of FORMATS); int4 runs as
    Q4_1 blocks on the C kernel where it builds, else on torch's int4 kernel."""
    if fmt == "int4" and block_linear.library() is not None:
        return Q4_1Weight(weight)
    return FORMATS[fmt](weight)


def quantize_head(weight: torch.Tensor, fmt: str) -> QuantizedWeight | None:
    """The vocab head for layers in format `fmt`: Q8_0 blocks beside int4 on the C kernel (a GGUF's
    own head format, fp32 logits), else None (the head stays fp32)."""
    if fmt == "int4" and block_linear.library() is not None and weight.shape[1] % GROUP == 0:
        return Q8_0Weight(weight)
    return None
