"""The backend contract: the device work of a forward, and how a model's weights get ready for it.

A backend is the one place a device shows: the model calls these ops and never asks what it runs
on; the loader asks the backend to put the GEMM weights in its form. Three implement it, each
checked against this class by mypy (they subclass it):

    backend            ops                                          weights (prepare_weights)
    ReferenceBackend   plain torch (ops/reference.py), the oracle   left as loaded (F.linear)
    CpuBackend         C kernels for the per-layer ops and paged    oneDNN-prepacked, int8 / int4, or
                       attention (ops/cpu/), reference elsewhere    a GGUF's own formats (ops/weights/)
    CudaBackend        CuPy RawKernels (ops/cuda/*.cu)              as loaded, or CUDA int8

Shapes: T = tokens in the step, H = hidden, Hq/Hk = query/kv heads, D = head_dim,
B = decoding sequences, S = prefilling sequences, I = intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from gpu_worker.ops.weights.gguf_weight import FileTensor

# What a weight becomes in a backend's form: a (maybe prepacked) parameter or a quantized module.
LinearWeight = nn.Module | nn.Parameter


class PreparableModel(Protocol):
    """What a backend needs of a model to convert its GEMM weights (gpu_worker/model/llama.py has it)."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def lm_head(self) -> torch.Tensor: ...

    def map_linear_weights(self, convert: Callable[[torch.Tensor], LinearWeight]) -> None:
        """Replace every layer's GEMM weight [N, K] by convert(weight)."""
        ...

    def set_lm_head(self, head: LinearWeight) -> None:
        """Replace the vocab projection [V, H] (untied from the embedding from then on)."""
        ...

    def map_file_weights(self, convert: Callable[[list[FileTensor]], LinearWeight]) -> None:
        """Replace every GEMM weight (and head) loaded in a GGUF file's own formats by convert(its row blocks)."""
        ...


class Backend(Protocol):
    """One device's ops (same signatures and semantics as ops/reference.py) and weight preparation."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, H], weight: [H] -> [T, H] (fp32 statistics, cast back to x.dtype)."""
        ...

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, H] -> (rms_norm(x + residual) [T, H], x + residual [T, H])."""
        ...

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                         interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64, q: [T, Hq, D], k: [T, Hk, D], cos_sin: [max_pos, D] fp32
        -> (q_rot [T, Hq, D], k_rot [T, Hk, D])."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]."""
        ...

    def write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        """k, v: [T, Hk, D] into k_cache, v_cache: [num_blocks, block_size, Hk, D] at flat slot
        slot_mapping[t] ([T] int64); slot -1 is skipped."""
        ...

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [B, Hq, D], block_tables: [B, max_blocks] int32, context_lens: [B] int32 -> [B, Hq, D]."""
        ...

    def paged_prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], block_tables: [S, max_blocks] int32, query_start_loc: [S + 1] int32,
        context_lens: [S] int32 -> [T, Hq, D], causal within each sequence's context."""
        ...

    def compute_dtype(self) -> torch.dtype:
        """The dtype a model runs in on this backend unless told otherwise (and its KV cache)."""
        ...

    def logits_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The vocab projection's dtype for a model computing in `dtype`."""
        ...

    def runs_file_formats(self, dtype: torch.dtype) -> bool:
        """Whether a quantized GGUF's GEMM weights can stay in the file's own block formats
        (ops/weights/gguf_weight.py) for a model computing in `dtype`; else the loader dequantizes them."""
        ...

    def prepare_weights(self, model: PreparableModel, quantization: str) -> bool:
        """Put the model's GEMM weights in this backend's form, `quantization` "none" or a weight format;
        False where the weights stay as loaded. The model is inference-only afterwards."""
        ...
