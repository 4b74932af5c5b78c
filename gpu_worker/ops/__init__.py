"""Hot ops behind one narrow interface, so the CUDA backend drops in without model changes.

Both backends export the same functions with the same signatures as `reference.py`:
rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul, write_kv_cache,
paged_decode_attention, paged_prefill_attention.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

_BACKENDS = {"cpu": "gpu_worker.ops.cpu.layer_ops", "cuda": "gpu_worker.ops.cuda.ops"}


def get_ops(device: str | torch.device) -> ModuleType:
    """The ops module for a device: "cpu" → the reference with C kernels (ops/cpu/layer_ops.py), "cuda"/"cuda:N" →
    CuPy kernels (lazy import)."""
    kind = torch.device(device).type
    if kind not in _BACKENDS:
        raise ValueError(f"no ops backend for device {device!r} (have: {', '.join(_BACKENDS)})")
    return importlib.import_module(_BACKENDS[kind])


def _cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a CUDA runtime mismatch raised at import
        return False
    return True


def select_device(setting: str) -> str:
    """Resolve the `--device` setting: "auto" → "cuda" when torch sees a GPU and CuPy imports, else "cpu"."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() and _cupy_available() else "cpu"
    if setting not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {setting!r}")
    return setting
