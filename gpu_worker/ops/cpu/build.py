"""Small C kernels for the CPU path, compiled once and called through ctypes.

Each kernel is one C file beside this module (`*.c`; one may #include another), compiled with
the system C compiler (`cc`, OpenMP) into `<cache_dir>/cpu_kernels/`, keyed by a hash of all the
sources and the flags; no torch headers, so a build takes about a second. On x86-64 the target
is x86-64-v3 (AVX2, FMA, F16C), not the build machine's own CPU, plus the extensions of one
variant at most (ISAS): the VNNI integer dot products and AVX-512's byte masks, which the kernels
use where the compiler defines them. `load` takes the variant this CPU runs (`cpu_isa`, from
/proc/cpuinfo's flags); `python -m gpu_worker.ops.cpu.build`, as the container image runs at build time, builds every
variant, so the image serves any AVX2 machine without a compiler. A CPU without AVX2 gets none of
them. Where there is no compiler and no prebuilt file, or a file does not build for this CPU,
`load` returns None and the caller runs its torch fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import structlog
import torch

from llmserve.catalog import model_store

logger = structlog.get_logger(__name__)

_X86 = platform.machine().lower() in ("x86_64", "amd64")
# a call to an undeclared function is an error here, not an "undefined symbol" when the library loads
CFLAGS = ["-O3", "-march=x86-64-v3" if _X86 else "-march=native", "-fopenmp", "-fPIC", "-shared",
          "-fno-math-errno", "-Werror=implicit-function-declaration"]
# the variants of x86-64-v3, best first: each named by the /proc/cpuinfo flags it needs, and its flags.
# On a CPU with AVX-512 (Zen 4, Ice Lake, Sapphire Rapids) the linears alone take it, in 256-bit
# vectors (block_linear.c's AVX512_REGIONS): VNNI dot products, byte masks (a Q5 weight's fifth bits,
# one pext and one masked add a vector against ten AVX2 operations) and 32 registers; AVX-VNNI (Alder
# Lake) is the VEX form of those dot products alone.
ISAS = {"avx512": (("avx512_vnni", "avx512vl", "avx512bw"), ["-DAVX512_REGIONS"]),
        "avxvnni": (("avx_vnni",), ["-mavxvnni"]),
        "avx2": ((), [])} if _X86 else {"native": ((), [])}
# libm, and on x86-64 glibc its vector math library (paged_attention.c's softmax calls libmvec's expf)
LIBS = ["-lm", "-lmvec"] if _X86 and platform.libc_ver()[0] == "glibc" else ["-lm"]


def _sources() -> list[Path]:
    """Every kernel source beside this module."""
    return sorted(Path(__file__).parent.glob("*.c"))


KERNELS = [path.stem for path in _sources()]


@functools.cache
def cpu_isa() -> str:
    """The best of ISAS this CPU runs (the last, plain x86-64-v3, where /proc/cpuinfo is not there to say)."""
    try:
        line = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        line = None
    flags = set(line.group(1).split()) if line else set()
    return next(isa for isa, (needs, _) in ISAS.items() if flags.issuperset(needs))


def _flags(isa: str) -> list[str]:
    return CFLAGS + ISAS[isa][1]


def _build(source: Path, target: Path, isa: str) -> None:
    """Compile `source` into `target` (atomic: a concurrent worker sees the whole file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    compiler = os.environ.get("CC") or "cc"
    built = subprocess.run([compiler, *_flags(isa), str(source), "-o", str(tmp), *LIBS], check=True, capture_output=True)
    if built.stderr:  # gcc's warnings include undefined behaviour it found (an array read past its end)
        logger.warning("cpu kernel compiler warnings", kernel=source.stem, isa=isa,
                       compiler_output=built.stderr.decode(errors="replace")[-2000:])
    tmp.replace(target)


def _target(name: str, isa: str) -> Path:
    """The built file, keyed by every kernel source (a kernel may #include another) and the flags."""
    sources = b"".join(path.read_bytes() for path in _sources())
    digest = hashlib.sha256(sources + " ".join(_flags(isa) + LIBS).encode()).hexdigest()[:16]
    return model_store.cache_dir() / "cpu_kernels" / f"{name}-{isa}-{digest}.so"


@functools.cache
def load(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled `<name>.c` of this package for `isa` (default: this CPU's), built on first use; None where
    it cannot be built or loaded."""
    if _X86 and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.warning("cpu kernels need AVX2; using the torch fallback", kernel=name)
        return None
    isa = isa or cpu_isa()
    source, target = Path(__file__).with_name(f"{name}.c"), _target(name, isa)
    try:
        if not target.exists():
            if shutil.which(os.environ.get("CC") or "cc") is None:
                raise FileNotFoundError("no C compiler (cc)")
            _build(source, target, isa)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        logger.warning("cpu kernel unavailable; using the torch fallback", kernel=name, error=str(exc),
                       compiler_output=stderr.decode(errors="replace")[-500:])
        return None


def bind(name: str, signatures: dict[str, tuple[list, type | None]], isa: str | None = None) -> ctypes.CDLL | None:
    """`load(name, isa)` with each named function's (argtypes, restype) set; None where it cannot be built."""
    lib = load(name, isa or cpu_isa())  # resolved before load's cache, which keys on it
    if lib is not None:
        for function, (argtypes, restype) in signatures.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = restype
    return lib


def traced(name: str) -> contextlib.AbstractContextManager:
    """A torch profiler range named `name` around a ctypes call, which the profiler does not see
    otherwise; a no-op when no profiler runs, since a range costs time on every kernel call."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def main() -> int:
    """Build every kernel in every variant into the cache dir (a container image runs this at build time)."""
    built = [(name, isa) for name in KERNELS for isa in ISAS if load(name, isa) is not None]  # load logs why not
    for name, isa in built:
        logger.info("cpu kernel built", kernel=name, isa=isa, path=str(_target(name, isa)))
    return 0 if len(built) == len(KERNELS) * len(ISAS) else 1


if __name__ == "__main__":
    sys.exit(main())
