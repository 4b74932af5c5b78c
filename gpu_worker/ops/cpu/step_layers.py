"""ctypes binding of step_layers.c: every decoder layer of a CPU step in one call (Q4_1 weights, fp32).

The runner builds the arguments from a prepared model and a step's metadata
(gpu_worker/runner/cpu_step_layers.py); see the C file for what it computes.
"""

from __future__ import annotations

import ctypes
import functools

from gpu_worker.ops.cpu import build

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# dims (layers, tokens, hidden, heads, kv heads, head_dim, intermediate), 12 pointers (h, out, residual,
# weights, scales, offsets, norms, k and v caches, positions, slots, cos_sin), interleaved, tables, table
# width, context lengths, block size, scale, eps, threads
_ARGS = [_I] * 7 + [_P] * 12 + [_I, _P, _I, _P, _I, _F, _F, _I]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (ops/cpu/build.py), built on first use; None where it cannot be built."""
    return build.bind("step_layers", {"step_layers_q4_1_f32": (_ARGS, ctypes.c_int)})
