"""The kernel sources compile with NVRTC exactly as CuPy's RawModule feeds them at run time
(common.cuh inlined, kernels.NVRTC_OPTIONS, template name expressions), without a GPU.

Needs libnvrtc (the `nvidia-cuda-nvrtc` wheel, or a CUDA toolkit); skipped with the reason otherwise.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

import pytest

from gpu_worker.ops.cuda import kernels


def _find_libnvrtc() -> str | None:
    dirs = []
    spec = importlib.util.find_spec("nvidia")
    if spec and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            dirs += glob.glob(os.path.join(root, "cu*", "lib")) + glob.glob(os.path.join(root, "cuda_nvrtc", "lib"))
    dirs += ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"]
    for d in dirs:
        for name in sorted(glob.glob(os.path.join(d, "libnvrtc.so*")), key=len):
            if "builtins" not in name and "alt" not in name:
                return name
    return None


LIB = _find_libnvrtc()
pytestmark = pytest.mark.skipif(LIB is None, reason="libnvrtc not found: NVRTC compile NOT checked")


class Nvrtc:
    def __init__(self, path: str) -> None:
        # libnvrtc dlopens its builtins library by soname; preload it from the same folder
        for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")):
            if "alt" not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(code).decode()}")

    def compile(self, source: str, name: str, options: list[str], expressions: list[str]) -> tuple[bool, str, dict]:
        """-> (ok, log, {name expression: lowered (mangled) name})."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "create")
        try:
            for e in expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, e.encode()), f"add {e}")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            lowered = {}
            if rc == 0:
                for e in expressions:
                    out = ctypes.c_char_p()
                    self._check(self.lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(out)), f"lower {e}")
                    lowered[e] = out.value.decode()
            return rc == 0, buf.value.decode(errors="replace"), lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("filename", sorted(kernels.hot_name_expressions()))
def test_nvrtc_compiles_kernel_file(filename, arch):
    expressions = kernels.hot_name_expressions()[filename]
    if filename == "paged_attention.cu":  # fp32 decode (engine tests) and another block size
        expressions = [*expressions, kernels.decode_kernel_name(__import__("torch").float32, 64, 16, 4),
                       kernels.decode_kernel_name(__import__("torch").bfloat16, 128, 32, 4)]
    ok, log, lowered = Nvrtc(LIB).compile(kernels.kernel_source(filename), filename,
                                          [*kernels.NVRTC_OPTIONS, f"--gpu-architecture={arch}"], expressions)
    assert ok, f"NVRTC failed on {filename}:\n{log}"
    assert set(lowered) == set(expressions) and all(v.startswith("_Z") for v in lowered.values())
    assert "warning" not in log.lower(), log
