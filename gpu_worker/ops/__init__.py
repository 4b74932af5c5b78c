"""Device work behind one typed contract (backend.py), so the model runs on any backend unchanged.

    ops/
      backend.py     the contract: Backend (ops + weight preparation), PreparableModel
      reference.py   plain torch: ReferenceBackend, the oracle every kernel is tested against
      cpu/           CpuBackend: C kernels (*.c, built on first use) and their ctypes bindings
      cuda/          CudaBackend: CuPy RawKernels (*.cu) and the ops that launch them
      weights/       GEMM weight formats: oneDNN-prepacked, weight-only int8 / int4
"""

from __future__ import annotations

import functools
import importlib

import torch

from gpu_worker.ops.backend import Backend

# device type -> (module, class) of its backend; imported on first use (the CUDA one never on a CPU worker)
_BACKENDS = {"cpu": ("gpu_worker.ops.cpu.backend", "CpuBackend"), "cuda": ("gpu_worker.ops.cuda.backend", "CudaBackend")}


@functools.cache
def _backend(kind: str) -> Backend:
    if kind not in _BACKENDS:
        raise ValueError(f"no ops backend for device {kind!r} (have: {', '.join(_BACKENDS)})")
    module, name = _BACKENDS[kind]
    backend: Backend = getattr(importlib.import_module(module), name)()
    return backend


def get_backend(device: str | torch.device) -> Backend:
    """The backend for a device: "cpu" -> CpuBackend (C kernels), "cuda"/"cuda:N" -> CudaBackend (CuPy kernels)."""
    return _backend(torch.device(device).type)


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
