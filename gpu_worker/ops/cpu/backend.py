"""The CPU backend: C kernels for the per-layer ops (layer_ops.py) and paged attention
(paged_attention.py), the torch reference where a kernel cannot run; GEMM weights prepacked for
oneDNN or weight-only quantized (gpu_worker/ops/weights/).

With int4 weights a step can run every layer in one C call instead (step_layers.c); the runner
decides that (gpu_worker/runner/cpu_step_layers.py), the ops here stay the per-layer path.
"""

from __future__ import annotations

import torch

from gpu_worker.ops.backend import Backend, LinearWeight, PreparableModel
from gpu_worker.ops.cpu import block_linear, kquant_linear, layer_ops, paged_attention
from gpu_worker.ops.weights import gguf_weight, packed_linear, quantized_linear


def _cpu_weight(weight: torch.Tensor, quantization: str) -> LinearWeight:
    """A plain [N, K] weight -> its CPU GEMM form: prepacked ("none") or quantized."""
    if quantization == "none":
        return torch.nn.Parameter(packed_linear.pack(weight), requires_grad=False)
    return quantized_linear.quantize(weight, quantization)


class CpuBackend(Backend):
    name = "cpu"
    rms_norm = staticmethod(layer_ops.rms_norm)
    fused_add_rms_norm = staticmethod(layer_ops.fused_add_rms_norm)
    rotary_embedding = staticmethod(layer_ops.rotary_embedding)
    silu_and_mul = staticmethod(layer_ops.silu_and_mul)
    write_kv_cache = staticmethod(layer_ops.write_kv_cache)
    paged_decode_attention = staticmethod(paged_attention.paged_decode_attention)
    paged_prefill_attention = staticmethod(paged_attention.paged_prefill_attention)

    def compute_dtype(self) -> torch.dtype:
        """fp32. With prepacked weights bf16 runs the engine faster than fp32 where the CPU has
        AVX512-BF16 (docs/performance.md), and its GEMM rows are bitwise batch-invariant too. But
        attention over a chunked or recomputed prefill sums in another order than over decode steps;
        in bf16 that difference (~1e-3) reaches the logits, and a preempted-and-recomputed or
        differently chunked sequence then drew other sampled tokens (tests/integration/test_engine.py
        failed with bf16). In fp32 it stays ~1e-7. fp32 keeps a sequence's tokens independent of
        batching, chunking and preemption; `--dtype bfloat16` trades that for speed."""
        return torch.float32

    def logits_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """fp32: bf16 logits round near-ties together and flip greedy choices."""
        return torch.float32

    def runs_file_formats(self, dtype: torch.dtype) -> bool:
        """On an fp32 model where the block and K-quant C kernels build and oneDNN can prepack."""
        kernels = block_linear.library() is not None and kquant_linear.library() is not None
        return dtype == torch.float32 and kernels and packed_linear.available(dtype)

    @torch.no_grad()
    def prepare_weights(self, model: PreparableModel, quantization: str) -> bool:
        """Every layer GEMM weight oneDNN-prepacked fp32/bf16 (ops/weights/packed_linear.py) or, with
        `quantization` int8/int4, weight-only quantized (ops/weights/quantized_linear.py). The vocab head
        stays prepacked fp32 (bf16 logits would round near-ties together), except beside int4 on the
        block kernel: Q8_0 blocks with fp32 logits, as a GGUF file keeps it. With `quantization`
        gguf_weight.FILE_FORMATS, the weights a GGUF loaded as FileTensors (and its head) keep the file's
        formats (ops/weights/gguf_weight.py). False where this torch build or CPU cannot prepack."""
        if not packed_linear.available(model.dtype):
            return False
        if quantization == gguf_weight.FILE_FORMATS:
            model.map_file_weights(gguf_weight.cpu_weight)
            return True
        model.map_linear_weights(lambda weight: _cpu_weight(weight, quantization))
        head = quantized_linear.quantize_head(model.lm_head, quantization)
        model.set_lm_head(head if head is not None else _cpu_weight(model.lm_head, "none"))
        return True
