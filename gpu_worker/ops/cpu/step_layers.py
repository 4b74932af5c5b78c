"""ctypes binding of step_layers.c: every decoder layer of a CPU step in one call (fp32 activations and
KV, each GEMM weight on its own C kernel).

The runner builds the arguments from a prepared model and a step's metadata
(gpu_worker/runner/cpu_step_layers.py); see the C file for what it computes.
"""

from __future__ import annotations

import ctypes
import functools

from gpu_worker.ops.cpu import build

KINDS = ("q4_1", "q8_0", "q5_1", "k2", "k3", "k4", "k5", "k6", "q4_0", "q5_0", "parts")  # the C file's KIND_* enum, in order
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# dims (layers, tokens, hidden, heads, kv heads, head_dim, intermediate), 10 pointers (h, out, residual,
# weights, norms, k and v caches, positions, slots, cos_sin), interleaved, tables, table width, context
# lengths, block size, scale, eps, threads
_ARGS = [_I] * 7 + [_P] * 10 + [_I, _P, _I, _P, _I, _F, _F, _I]


class Weight(ctypes.Structure):
    """The C file's Weight: a GEMM weight's kernel and the arrays it reads, or ("parts") its row blocks of
    several kinds, `num_parts` Weights from `parts`, each of `rows` rows."""


Weight._fields_ = [("kind", ctypes.c_int), ("codes", _P), ("d", _P), ("offset", _P), ("sc", _P), ("mn", _P),
                   ("rows", ctypes.c_int), ("num_parts", ctypes.c_int), ("parts", ctypes.POINTER(Weight))]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (ops/cpu/build.py), built on first use; None where it cannot be built."""
    return build.bind("step_layers", {"step_layers_f32": (_ARGS, ctypes.c_int)})
