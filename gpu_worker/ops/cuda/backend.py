"""The CUDA backend: CuPy kernels for every op (ops.py), GEMMs on cuBLAS, or weight-only int8 on a
decode GEMV kernel (ops/weights/quantized_linear.py CUDA_FORMATS)."""

from __future__ import annotations

import torch

from gpu_worker.ops.backend import Backend, PreparableModel
from gpu_worker.ops.cuda import ops
from gpu_worker.ops.weights import quantized_linear


class CudaBackend(Backend):
    name = "cuda"
    rms_norm = staticmethod(ops.rms_norm)
    fused_add_rms_norm = staticmethod(ops.fused_add_rms_norm)
    rotary_embedding = staticmethod(ops.rotary_embedding)
    silu_and_mul = staticmethod(ops.silu_and_mul)
    write_kv_cache = staticmethod(ops.write_kv_cache)
    paged_decode_attention = staticmethod(ops.paged_decode_attention)
    paged_prefill_attention = staticmethod(ops.paged_prefill_attention)

    def compute_dtype(self) -> torch.dtype:
        """bf16 on GPUs with native bf16 (sm_80+), else fp16: torch calls bf16 "supported" on older GPUs
        too, by emulating it (slow matmuls)."""
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16

    def logits_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The compute dtype, as vLLM does."""
        return dtype

    def runs_file_formats(self, dtype: torch.dtype) -> bool:
        """No: a quantized GGUF loads dequantized to the model dtype on CUDA."""
        return False

    @torch.no_grad()
    def prepare_weights(self, model: PreparableModel, quantization: str) -> bool:
        """With `quantization` other than "none", the layers' GEMM weights in a weight-only quantized CUDA
        form (quantized_linear.CUDA_FORMATS); the vocab head stays in the model dtype."""
        if quantization == "none":
            return False
        if quantization not in quantized_linear.CUDA_FORMATS:
            raise ValueError(f"quantization {quantization!r} has no CUDA form (have: "
                             f"{', '.join(quantized_linear.CUDA_FORMATS)})")
        model.map_linear_weights(quantized_linear.CUDA_FORMATS[quantization])
        return True
