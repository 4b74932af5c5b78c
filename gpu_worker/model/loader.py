"""load_model: a model spec (alias, GGUF file or HF directory) -> LlamaModel on a device."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from gpu_worker.model import gguf_loader, hf_loader
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.ops import packed_linear
from llmserve import model_store

logger = structlog.get_logger(__name__)

def _cpu_multiplies_bf16() -> bool:
    """AVX512-BF16 or AMX: the cores have bf16 dot-product instructions (elsewhere oneDNN
    emulates bf16 and fp32 is the faster choice)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def default_dtype(device: str | torch.device) -> torch.dtype:
    """Compute dtype for a device: bf16 on GPUs that support it, else fp16; on CPU whichever is
    faster there, bf16 on cores with bf16 instructions when weights can be prepacked, else fp32.

    On CPU, bf16 is only the default with prepacked weights: plain MKL/oneDNN bf16 GEMMs give a
    row different bits in a batch than alone, which changed greedy output with batch composition
    and prefix-cache hits; the prepacked ones do not (see ops/packed_linear.py). On a 2-core
    AVX512-BF16 EPYC, bf16 runs the engine 1.3x faster than fp32 (`python -m bench.engine`).
    """
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_multiplies_bf16() and packed_linear.available() else torch.float32


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


def load_model(spec: str | Path, device: str, dtype: torch.dtype | None = None, prepack: bool = True) -> LlamaModel:
    """Build the model for `spec` (alias like "smollm2-135m", a .gguf path, or an HF directory).

    prepack: on CPU, put GEMM weights in oneDNN's blocked layout (LlamaModel.prepack_for_cpu).
    """
    start = time.monotonic()
    path = model_store.resolve(str(spec))
    dtype = dtype or default_dtype(device)
    config, weights = _source(path)
    model = LlamaModel(config, device=device, dtype=dtype)
    model.load_weights(weights)
    model.eval()
    prepacked = prepack and model.prepack_for_cpu()
    logger.info(
        "model loaded", path=str(path), device=str(device), dtype=str(dtype).removeprefix("torch."), prepacked=prepacked,
        layers=config.num_layers, hidden=config.hidden_size, seconds=round(time.monotonic() - start, 2),
    )
    return model
