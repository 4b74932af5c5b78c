"""The CPU backend's per-layer small ops, each one ctypes call into layer_ops.c.

A decode step of one sequence spends more time dispatching small torch ops than computing them
(about 40 dispatches per layer for two norms, the rotary embedding and the cache write). Here each,
and silu_and_mul, is one ctypes call into layer_ops.c (paged attention reads the cache in place:
paged_attention.py). Same contract as `reference` (gpu_worker/ops/backend.py); where a C kernel
cannot be built, or a tensor is not fp32 with contiguous heads, the reference op runs.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from gpu_worker.ops import reference
from gpu_worker.ops.cpu import build

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES: dict[str, tuple[list[Any], type | None]] = {
    "rms_norm_f32": ([_P, _L, _P, _L, _P, _P, _P, _I, _I, _F], None),
    "rotary_f32": ([_P, _L, _P, _L, _P, _P, _P, _P, _I, _I, _I, _I, _I], None),
    "write_kv_f32": ([_P, _L, _P, _L, _P, _P, _P, _I, _I], None),
    "silu_and_mul_f32": ([_P, _I, _I, _P, _I], None),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (ops/cpu/build.py), built on first use; None where they cannot be built."""
    return build.bind("layer_ops", _SIGNATURES)


def _kernels() -> ctypes.CDLL:
    """library(), for a caller that `_rows` let through (so it is built)."""
    lib = library()
    assert lib is not None
    return lib


def _rows(*tensors: torch.Tensor) -> bool:
    """True where the C kernels can take these: fp32, each row ([H] or [heads, D]) contiguous, any row stride."""
    if library() is None:
        return False
    for t in tensors:
        if t.dtype != torch.float32 or t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2]):
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H], weight: [H] -> [T, H]."""
    if x.shape[0] == 0 or not _rows(x, weight):
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    _kernels().rms_norm_f32(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), None,
                           x.shape[0], x.shape[1], eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) [T, H], x + residual [T, H])."""
    if x.shape[0] == 0 or not _rows(x, residual, weight):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out, total = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    _kernels().rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                           out.data_ptr(), total.data_ptr(), x.shape[0], x.shape[1], eps)
    return out, total


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64, q: [T, Hq, D], k: [T, Hk, D], cos_sin: [max_pos, D] fp32
    -> (q_rot [T, Hq, D], k_rot [T, Hk, D]) contiguous."""
    if q.shape[0] == 0 or positions.dtype != torch.int64 or not _rows(q, k, cos_sin):
        return reference.rotary_embedding(positions, q, k, cos_sin, interleaved)
    positions = positions.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    _kernels().rotary_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
                         cos_sin.contiguous().data_ptr(), q_out.data_ptr(), k_out.data_ptr(), num_tokens, num_heads,
                         k.shape[1], head_dim, int(interleaved))
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> silu(x[:, :I]) * x[:, I:]  [T, I]."""
    if x.shape[0] == 0 or not x.is_contiguous() or not _rows(x):
        return reference.silu_and_mul(x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    _kernels().silu_and_mul_f32(x.data_ptr(), x.shape[0], inter, out.data_ptr(), torch.get_num_threads())
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D] written in place into k_cache, v_cache: [num_blocks, block_size, Hk, D]
    at flat slot slot_mapping[t]; slot -1 is skipped."""
    if (k.shape[0] == 0 or slot_mapping.dtype != torch.int64 or not _rows(k, v)
            or not (k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.is_contiguous()
                    and v_cache.is_contiguous())):
        return reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.contiguous()
    _kernels().write_kv_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr(), k.shape[0], k.shape[1] * k.shape[2])
