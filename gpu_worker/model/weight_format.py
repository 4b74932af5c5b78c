"""The weight format a loaded model serves, in the words ListModels and `/v1/models` use (docs/models.md):

    "gguf:<file type>"   GEMM weights kept in the GGUF file's own blocks (CPU C kernels); <file type> is
                         llama-quantize's name of general.file_type ("Q4_K_M", "Q4_1", "Q8_0", ...)
    "int8" / "int4"      quantized by llmserve at load (`--quantization`, ops/weights/quantized_linear.py)
    "f32" / "bf16" / "f16"   dense in that dtype: safetensors, a float GGUF, or a quantized GGUF dequantized
                         (on CUDA, or where the C kernels do not build)
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_worker.ops.weights import gguf_weight
from llmserve.catalog import gguf_file
from llmserve.catalog.gguf_metadata import FILE_TYPES

DENSE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def dense_format(dtype: torch.dtype) -> str:
    """The name of weights kept dense in `dtype` ("f32", "bf16", "f16")."""
    return DENSE.get(dtype, str(dtype).removeprefix("torch."))


def gguf_file_type(path: Path) -> str:
    """llama-quantize's name of a GGUF's general.file_type ("Q4_K_M"), "" where the file does not say."""
    code = gguf_file.metadata(path).get("general.file_type")
    if code is None:
        return ""
    code = int(code)
    return FILE_TYPES.get(code, f"file_type {code}")


def served_format(path: Path, quantization: str, prepared: bool, dtype: torch.dtype) -> str:
    """What the GEMMs of a model loaded from `path` run on, given load_model's choice.

    Args:
        quantization: the weight format load_model chose ("gguf" for the file's own, "int4", "none", ...).
        prepared: whether the backend put the weights in that format.
        dtype: the model's compute dtype.
    """
    if prepared and quantization == gguf_weight.FILE_FORMATS:
        file_type = gguf_file_type(path)
        return f"gguf:{file_type}" if file_type else "gguf"
    if prepared and quantization != "none":
        return quantization
    return dense_format(dtype)
