"""Run gpu_worker/ops/cuda/*.cu on the CPU: g++ builds the unchanged sources against cuda_shim.h into a
shared object (cached by source hash), ctypes calls it, and `CpuLauncher` plugs it into
gpu_worker.ops.cuda.ops as the launcher, so the ops' own planning, grids and argument packing run.

    with cuda.use_launcher(CpuLauncher(order=Order.RANDOM)):
        out = cuda.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)   # CPU tensors

Builds: one .so per (.cu file, kernel variants, flags). The cache lives in $LLMSERVE_KERNEL_CACHE or
<tmp>/llmserve-cuda-cpu; a build is written to a temporary name and renamed, so parallel test
processes share it safely.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu_worker.ops.cuda import kernels

SHIM = Path(__file__).resolve().parent / "cuda_shim.h"
CXX = shutil.which(os.environ.get("CXX", "g++"))
BASE_FLAGS = ("-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-variable",
              "-Wno-unused-but-set-variable", "-fno-strict-aliasing")
FAST_FLAGS = ("-O1", "-fsanitize=alignment")
ASAN_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,alignment")

# template <params> __global__ void [__launch_bounds__(expr)] name(
_KERNEL = re.compile(r"(?:template\s*<(?P<params>[^{};]*?)>\s*)?__global__\s+void\s+"
                     r"(?:__launch_bounds__\((?P<bound>[^)]*)\)\s+)?(?P<name>\w+)\s*\(")


def unavailable_reason() -> str | None:
    """Why kernels cannot run on this CPU (None when they can)."""
    if CXX is None:
        return "g++ not found: CUDA kernels NOT executed on the CPU"
    if os.uname().machine != "x86_64":
        return f"the fiber shim is x86-64 only (this is {os.uname().machine})"
    return None


def asan_enabled() -> bool:
    """LLMSERVE_KERNELS_ASAN=1 (make test-kernels-asan): build with AddressSanitizer (needs libasan preloaded)."""
    return os.environ.get("LLMSERVE_KERNELS_ASAN") == "1"


def cache_dir() -> Path:
    root = Path(os.environ.get("LLMSERVE_KERNEL_CACHE") or Path(tempfile.gettempdir()) / "llmserve-cuda-cpu")
    root.mkdir(parents=True, exist_ok=True)
    return root


class KernelError(RuntimeError):
    """A launch the shim refused or a kernel fault: misaligned access, shuffle or barrier misuse,
    deadlock, launch bounds, argument mismatch."""


class Order(enum.IntEnum):
    """Order in which blocks run and threads of a block are resumed (cuda_shim.h Order)."""

    FORWARD = 0
    REVERSE = 1
    RANDOM = 2


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("order", ctypes.c_int),
                ("seed", ctypes.c_uint)]


# ---------------------------------------------------------------- build


@dataclass(frozen=True)
class KernelSpec:
    """One __global__ template of a source: its template parameters and __launch_bounds__ expression."""

    namespace: str
    name: str
    params: str | None
    bound: str | None

    def bound_definition(self) -> str:
        """A variable template next to the kernel evaluating its launch bound (CUDA's 1024 without one)."""
        head = f"template <{self.params}> " if self.params is not None else ""
        return f"namespace {self.namespace} {{ {head}constexpr int launch_bound_{self.name} = ({self.bound or 1024}); }}"


def kernel_specs(source: str, namespace: str) -> dict[str, KernelSpec]:
    return {m["name"]: KernelSpec(namespace, m["name"], m["params"], m["bound"]) for m in _KERNEL.finditer(source)}


def split_name(expression: str) -> tuple[str, str, str]:
    """'llmserve::paged_decode_kernel<llmserve::f16, 64>' -> ('llmserve', 'paged_decode_kernel', '<...>')."""
    head, _, args = expression.partition("<")
    namespace, _, name = head.rpartition("::")
    return namespace, name, f"<{args}" if args else ""


def translation_unit(source_path: Path, expressions: list[str]) -> str:
    """The shim, the unchanged .cu, a launch-bound constant per kernel and one C entry per variant."""
    source = source_path.read_text()
    namespaces = {split_name(e)[0] for e in expressions}
    specs = {name: spec for ns in namespaces for name, spec in kernel_specs(source, ns).items()}
    lines = ['#include "cuda_shim.h"', f'#include "{source_path}"']
    lines += [spec.bound_definition() for spec in specs.values()]
    for i, expr in enumerate(expressions):
        namespace, name, args = split_name(expr)
        if name not in specs:
            raise KernelError(f"{expr}: no __global__ {name} in {source_path.name}")
        lines.append(
            f'CUDASHIM_EXPORT int cudashim_launch_{i}(const cudashim::LaunchConfig* c, void** a, const char* k, '
            f"const int* s) {{ return cudashim::launch(*c, &{expr}, {namespace}::launch_bound_{name}{args}, "
            f'"{expr}", a, k, s); }}')
    return "\n".join(lines) + "\n"


def _build_key(source_path: Path, expressions: list[str], flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for path in sorted({source_path, SHIM, *source_path.parent.glob("*.cuh"), *kernels.KERNEL_DIR.glob("*.cuh")}):
        h.update(str(path).encode() + b"\0" + path.read_bytes())
    h.update("\0".join([*expressions, *flags, CXX or ""]).encode())
    return h.hexdigest()[:24]


def build(source_path: Path, expressions: list[str]) -> Path:
    """Compile (or find in the cache) the .so holding `expressions` of `source_path`."""
    flags = ASAN_FLAGS if asan_enabled() else FAST_FLAGS
    target = cache_dir() / f"{source_path.stem}-{_build_key(source_path, expressions, flags)}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        tu = Path(tmp) / f"{source_path.stem}_cpu.cpp"
        tu.write_text(translation_unit(source_path, expressions))
        obj = Path(tmp) / "kernels.o"
        # compiled with -fsanitize=alignment but linked without the UBSan runtime: cuda_shim.h is its handler
        _run([CXX, *BASE_FLAGS, *flags, f"-I{SHIM.parent}", f"-I{kernels.KERNEL_DIR}", "-c", str(tu), "-o", str(obj)])
        link_asan = ["-fsanitize=address"] if "-fsanitize=address,alignment" in flags else []
        _run([CXX, "-shared", *link_asan, str(obj), "-o", str(Path(tmp) / "k.so")])
        os.replace(Path(tmp) / "k.so", target)
    return target


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KernelError(f"g++ failed ({' '.join(cmd[:1] + cmd[-3:])}):\n{proc.stderr[-6000:]}")


class Module:
    """A loaded .so: launch(expression, config, args) -> None, raising KernelError on a fault."""

    def __init__(self, path: Path, expressions: list[str]) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.cudashim_error.restype = ctypes.c_char_p
        self.entries = {e: getattr(self.lib, f"cudashim_launch_{i}") for i, e in enumerate(expressions)}

    def launch(self, expression: str, config: _LaunchConfig, args: tuple) -> None:
        packed, kinds, sizes = _pack(args)
        ptrs = (ctypes.c_void_p * len(packed))(*[ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in packed])
        rc = self.entries[expression](ctypes.byref(config), ptrs, kinds.encode(), (ctypes.c_int * len(sizes))(*sizes))
        if rc != 0:
            raise KernelError(self.lib.cudashim_error().decode(errors="replace"))


_SCALARS = {np.int32: ("i", ctypes.c_int32), np.int64: ("l", ctypes.c_int64), np.float32: ("f", ctypes.c_float)}


def _pack(args: tuple) -> tuple[list, str, list[int]]:
    """Kernel arguments as ctypes values, kind letters (p pointer, i int32, l int64, f float) and sizes."""
    packed, kinds, sizes = [], "", []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                raise KernelError(f"CPU kernels need CPU tensors, got one on {a.device}")
            packed.append(ctypes.c_void_p(a.data_ptr()))
            kinds += "p"
            sizes.append(a.element_size())
        elif type(a) in _SCALARS:
            kind, ctype = _SCALARS[type(a)]
            packed.append(ctype(a.item()))
            kinds += kind
            sizes.append(ctypes.sizeof(ctype))
        else:
            raise KernelError(f"kernel argument {a!r} of type {type(a).__name__}: pass a tensor or a numpy scalar")
    return packed, kinds, sizes


# ---------------------------------------------------------------- the launcher


class KernelLibrary:
    """Loaded modules by (source, variants), built on first use."""

    def __init__(self) -> None:
        self._modules: dict[tuple, Module] = {}
        self._lock = threading.Lock()

    def module(self, source_path: Path, expressions: list[str]) -> Module:
        key = (source_path, tuple(expressions))
        with self._lock:
            if key not in self._modules:
                self._modules[key] = Module(build(source_path, expressions), expressions)
            return self._modules[key]


LIBRARY = KernelLibrary()
_RUNTIME_LOCK = threading.Lock()


MAX_VARIANTS_PER_BUILD = 36  # paged_attention.cu's ~100 variants build as three .so in parallel


def variant_groups(variants: dict[str, list[str]]) -> dict[tuple[str, int], list[str]]:
    """{(filename, part): variants}: the unit of one g++ build."""
    return {(filename, i // MAX_VARIANTS_PER_BUILD): names[i : i + MAX_VARIANTS_PER_BUILD]
            for filename, names in variants.items() for i in range(0, len(names), MAX_VARIANTS_PER_BUILD)}


def build_all(kernel_dir: Path, variants: dict[str, list[str]], jobs: int = 2) -> None:
    """Build every group of `variants` up front, `jobs` g++ processes at a time."""
    groups = [(kernel_dir / filename, names) for (filename, _), names in variant_groups(variants).items()]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda item: build(*item), groups))


class CpuLauncher:
    """gpu_worker.ops.cuda.ops's launcher seam, executing on the CPU with CPU tensors.

    Args:
        order: block and thread order of every launch (a race shows as a different result).
        seed: seed of the RANDOM order.
        kernel_dir: where the .cu files are read (a mutant copy in the mutation test).
        variants: the variants built per .cu file (default: all the worker can launch).

    Output buffers the ops allocate through `empty` start as NaN, so a read of an unwritten element shows.
    """

    def __init__(self, order: Order = Order.FORWARD, seed: int = 0, kernel_dir: Path = kernels.KERNEL_DIR,
                 variants: dict[str, list[str]] | None = None) -> None:
        self.order, self.seed, self.kernel_dir = order, seed, kernel_dir
        self.variants = variants if variants is not None else kernels.launchable_kernels()
        self._groups = {name: names for names in variant_groups(self.variants).values() for name in names}
        self.launched: list[str] = []

    def launch(self, filename: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
        if name not in self.variants.get(filename, ()):
            raise KernelError(f"{name} is not among the variants built for {filename}: add it to launchable_kernels()")
        module = LIBRARY.module(self.kernel_dir / filename, self._groups[name])
        config = _LaunchConfig((ctypes.c_uint * 3)(*_dims(grid)), (ctypes.c_uint * 3)(*_dims(block)),
                               int(self.order), self.seed)
        with _RUNTIME_LOCK:  # the shim runs one launch at a time
            module.launch(name, config, args)
        self.launched.append(name)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.full(shape, -1, dtype=dtype, device=device)


def _dims(d: tuple[int, ...]) -> tuple[int, int, int]:
    return tuple(int(x) for x in (*d, 1, 1)[:3])  # type: ignore[return-value]
