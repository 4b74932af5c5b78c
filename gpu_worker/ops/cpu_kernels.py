"""Small C kernels for the CPU path, compiled on first use and called through ctypes.

Each kernel is one C file beside this module, compiled once with the system C compiler (`cc`,
OpenMP, `-march=native`) into `<cache_dir>/cpu_kernels/`, keyed by a hash of its source and
flags; no torch headers, so a build takes about a second. Where there is no compiler, or a file
does not build for this CPU, `load` returns None and the caller runs its torch fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import structlog
import torch

from llmserve import model_store

logger = structlog.get_logger(__name__)

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]


def _build(source: Path, target: Path) -> None:
    """Compile `source` into `target` (atomic: a concurrent worker sees the whole file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, *CFLAGS, str(source), "-o", str(tmp), "-lm"], check=True, capture_output=True)
    tmp.replace(target)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled `<name>.c` of this package, built on first use; None where it cannot be built or loaded."""
    source = Path(__file__).with_name(f"{name}.c")
    digest = hashlib.sha256(source.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = model_store.cache_dir() / "cpu_kernels" / f"{name}-{digest}.so"
    try:
        if not target.exists():
            if shutil.which(os.environ.get("CC") or "cc") is None:
                raise FileNotFoundError("no C compiler (cc)")
            _build(source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        logger.warning("cpu kernel unavailable; using the torch fallback", kernel=name, error=str(exc),
                       compiler_output=stderr.decode(errors="replace")[-500:])
        return None


def traced(name: str) -> contextlib.AbstractContextManager:
    """A torch profiler range named `name` around a ctypes call, which the profiler does not see
    otherwise; a no-op when no profiler runs (a range costs ~10 us, 150 of them per decode step)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
