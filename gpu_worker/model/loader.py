"""load_model: a model spec (alias, GGUF file or HF directory) -> LlamaModel on a device."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from gpu_worker.model import architectures, gguf_loader, hf_loader
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.weight_format import served_format
from gpu_worker.ops import get_backend
from gpu_worker.ops.backend import Backend
from gpu_worker.ops.weights import gguf_weight, quantized_linear
from llmserve.catalog import gguf_file, model_store

logger = structlog.get_logger(__name__)

def default_dtype(device: str | torch.device) -> torch.dtype:
    """Compute dtype for a device, its backend's choice (Backend.compute_dtype)."""
    return get_backend(device).compute_dtype()


def _source(path: Path):
    """(config, weight iterator) for a GGUF file or an HF directory."""
    if hf_loader.is_hf_dir(path):
        return hf_loader.load_config(path), hf_loader.iter_weights(path)
    if gguf_loader.is_gguf(path):
        return gguf_loader.load(path)
    raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face directory with config.json")


def _file_formats(path: Path, backend: Backend, dtype: torch.dtype):
    """(config, weight iterator) of a quantized GGUF in its own formats (ops/weights/gguf_weight.py), which
    `--quantization auto` keeps where the backend runs them (Backend.runs_file_formats); else None."""
    if not gguf_loader.is_gguf(path):
        return None
    if backend.runs_file_formats(dtype):
        return gguf_loader.load_file_formats(path)
    logger.warning("gguf weights load dequantized: this backend and dtype do not run the file's formats",
                   path=str(path), backend=backend.name, dtype=str(dtype).removeprefix("torch."))
    return None


def check_supported(spec: str | Path, load_follows: bool = False) -> ModelConfig:
    """The config of a model spec from its metadata alone (no weights read, nothing converted).
    load_follows: a load_model of the spec comes next, and takes the GGUF reader built here
    (llmserve/catalog/gguf_file.py: it costs seconds).

    Raises:
        UnsupportedModel: the worker cannot run it; str() is the one line to exit with.
    """
    path = model_store.resolve(str(spec))
    if hf_loader.is_hf_dir(path):
        return hf_loader.load_config(path)
    if gguf_loader.is_gguf(path):
        return gguf_loader.read_config(gguf_file.open_reader(path, pass_on=load_follows))
    raise architectures.refusal(path, "a path that is neither a GGUF file nor a Hugging Face directory")


def load_config(spec: str | Path) -> ModelConfig:
    """Just the config of a model spec (converts a GGUF into the cache if needed)."""
    config, _ = _source(model_store.resolve(str(spec)))
    return config


def load_model(spec: str | Path, device: str, dtype: torch.dtype | None = None, prepack: bool = True,
               quantization: str = "none") -> LlamaModel:
    """Build the model for `spec` (alias like "smollm2-135m", a .gguf path, or an HF directory).

    prepack: let the device's backend put the GEMM weights in its form (Backend.prepare_weights: on CPU
    oneDNN's blocked layout or a quantized format, on CUDA a quantized one); False keeps them as loaded.
    quantization: weight format of the layers' GEMMs, "none" or a key of ops/weights/quantized_linear.FORMATS
    (on CPU) or of CUDA_FORMATS (on CUDA); "auto" picks one: on an fp32 CPU model a quantized GGUF keeps its
    own formats (gguf_weight.FILE_FORMATS), else quantized_linear.default_format.
    """
    start = time.monotonic()
    path = model_store.resolve(str(spec))
    dtype = dtype or default_dtype(device)
    backend = get_backend(device)
    file_formats = _file_formats(path, backend, dtype) if quantization == "auto" and prepack else None
    config, weights = file_formats or _source(path)
    gguf_file.let_go(path)  # a reader check_supported passed on, where _source took the converted cache
    model = LlamaModel(config, device=device, dtype=dtype)
    model.load_weights(weights)
    model.eval()
    if file_formats is not None:
        quantization = gguf_weight.FILE_FORMATS
    elif quantization == "auto":
        widths = [config.hidden_size, config.q_size, config.intermediate_size]  # the GEMMs' in_features
        quantization = quantized_linear.default_format(model.device, widths)
    prepared = prepack and backend.prepare_weights(model, quantization)
    model.weight_format = served_format(path, quantization, prepared, dtype)
    logger.info(
        "model loaded", path=str(path), device=str(device), dtype=str(dtype).removeprefix("torch."),
        backend=backend.name, weights_prepared=prepared, weight_format=model.weight_format,
        layers=config.num_layers, hidden=config.hidden_size, seconds=round(time.monotonic() - start, 2),
    )
    return model
