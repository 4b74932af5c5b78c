"""load_model: a model spec (alias, GGUF file or HF directory) -> LlamaModel on a device."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from gpu_worker.model import gguf_loader, hf_loader
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.ops.weights import quantized_linear
from llmserve import model_store

logger = structlog.get_logger(__name__)

# CPU compute dtype. With prepacked weights (ops/weights/packed_linear.py) bf16 runs the engine ~1.3x faster
# than fp32 on an AVX512-BF16 EPYC, and its GEMM rows are bitwise batch-invariant too. But attention
# over a chunked or recomputed prefill sums in another order than over decode steps; in bf16 that
# difference (~1e-3) reaches the logits, and a preempted-and-recomputed or differently chunked
# sequence then drew other sampled tokens (tests/integration/test_engine.py failed with bf16).
# In fp32 it stays ~1e-7. fp32 keeps a sequence's tokens independent of batching, chunking and
# preemption; `--dtype bfloat16` trades that for speed.
CPU_DTYPE = torch.float32


def default_dtype(device: str | torch.device) -> torch.dtype:
    """Compute dtype for a device: fp32 on CPU; bf16 on GPUs with native bf16 (sm_80+), else fp16.

    torch calls bf16 "supported" on older GPUs too, by emulating it (slow matmuls); those get fp16.
    """
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return CPU_DTYPE


def _source(path: Path):
    """(config, weight iterator) for a GGUF file or an HF directory."""
    if hf_loader.is_hf_dir(path):
        return hf_loader.load_config(path), hf_loader.iter_weights(path)
    if gguf_loader.is_gguf(path):
        return gguf_loader.load(path)
    raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face directory with config.json")


def load_config(spec: str | Path) -> ModelConfig:
    """Just the config of a model spec (converts a GGUF into the cache if needed)."""
    config, _ = _source(model_store.resolve(str(spec)))
    return config


def load_model(spec: str | Path, device: str, dtype: torch.dtype | None = None, prepack: bool = True,
               quantization: str = "none") -> LlamaModel:
    """Build the model for `spec` (alias like "smollm2-135m", a .gguf path, or an HF directory).

    prepack: on CPU, put GEMM weights in oneDNN's blocked layout (LlamaModel.prepack_for_cpu).
    quantization: weight format of the layers' GEMMs, "none" or a key of ops/weights/quantized_linear.FORMATS
    (on CPU, with prepack) or of CUDA_FORMATS (on CUDA); "auto" picks one (quantized_linear.default_format).
    """
    start = time.monotonic()
    path = model_store.resolve(str(spec))
    dtype = dtype or default_dtype(device)
    config, weights = _source(path)
    model = LlamaModel(config, device=device, dtype=dtype)
    model.load_weights(weights)
    model.eval()
    if quantization == "auto":
        widths = [config.hidden_size, config.q_size, config.intermediate_size]  # the GEMMs' in_features
        quantization = quantized_linear.default_format(model.device, widths)
    prepacked = prepack and model.prepack_for_cpu(quantization)
    quantized = prepacked and quantization != "none"
    if model.device.type == "cuda" and quantization != "none":
        model.quantize_for_cuda(quantization)
        quantized = True
    logger.info(
        "model loaded", path=str(path), device=str(device), dtype=str(dtype).removeprefix("torch."), prepacked=prepacked,
        quantization=quantization if quantized else "none",
        layers=config.num_layers, hidden=config.hidden_size, seconds=round(time.monotonic() - start, 2),
    )
    return model
