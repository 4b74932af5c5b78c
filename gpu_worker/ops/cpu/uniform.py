"""ctypes binding of uniform.c: rows of torch.rand's own CPU stream, one seed a row, in C.

`uniform_rows(seeds, n)` equals stacking `torch.rand(n, generator=torch.Generator().manual_seed(s))`
for each seed, bit for bit (tests/unit/test_cpu_uniform.py), several times faster than torch's
serial kernel (docs/performance.md); rows run on torch's thread count. Where the kernel cannot be
built, torch draws them.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from gpu_worker.ops.cpu import build

_SIGNATURE = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_int], None)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (ops/cpu/build.py), built on first use; None where it cannot be built."""
    return build.bind("uniform", {"uniform_rows_f32": _SIGNATURE})


def uniform_rows(seeds: list[int], n: int) -> torch.Tensor:
    """[len(seeds), n] float32 uniform in [0, 1): row r is torch.rand(n) after manual_seed(seeds[r])."""
    out = torch.empty(len(seeds), n)
    if not seeds:
        return out
    lib = library()
    if lib is None:
        for row, seed in zip(out, seeds):
            torch.rand(n, generator=torch.Generator().manual_seed(seed), out=row)
        return out
    seed_array = (ctypes.c_uint64 * len(seeds))(*seeds)
    lib.uniform_rows_f32(seed_array, len(seeds), n, out.data_ptr(), min(torch.get_num_threads(), len(seeds)))
    return out
