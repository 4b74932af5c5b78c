"""The CUDA backend's ops: CuPy RawKernels (NVRTC, the .cu files beside this module) run on torch tensors.

Same signatures and semantics as `reference.py` (contract: gpu_worker/ops/backend.py). Tensors
cross into CuPy through DLPack without copies, and every kernel is launched on torch's current
stream, so a decode step built from these ops can be captured in a CUDA graph (no host syncs on
the decode path: launch plans depend only on tensor shapes).

CuPy is imported on first launch, not at import time: the launch planning (kernels.py) and the
gather + SDPA prefill path are plain Python/torch and are unit-tested on CPU, and tests/cuda_cpu swaps
the launcher to run every kernel on the CPU.

Shapes: T = tokens, Hq/Hk = query/kv heads, D = head_dim, B = decoding sequences.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.ops import reference
from gpu_worker.ops.cuda.kernels import (
    CTYPE,
    DECODE_WARPS,
    HALF_TYPES,
    INT8_GEMV_MAX_TOKENS,
    INT8_GEMV_TOKENS,
    INT8_GEMV_WARPS,
    NVRTC_OPTIONS,
    decode_kernel_name,
    decode_kernel_supports,
    int8_gemv_kernel_name,
    kernel_source,
    norm_kernel_name,
    norm_warps,
    plan_decode,
    reduce_kernel_name,
    vec_width,
)


def _aligned16(t: torch.Tensor) -> bool:
    """16-byte accesses are legal on every row: the base is 16-byte aligned, row strides 8 elements."""
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def _vec_for(sizes: tuple[int, ...], *tensors: torch.Tensor) -> int:
    """vec_width, or 1 when a tensor is not 16-byte aligned (a view at an odd offset): a misaligned
    16-byte access faults on the GPU."""
    vec = vec_width(tensors[0].dtype, *sizes)
    return vec if vec == 1 or all(_aligned16(t) for t in tensors) else 1


# ---------------------------------------------------------------- CuPy bridge


@functools.cache
def _cp():
    import cupy  # deferred: importing this module must not need CuPy

    return cupy


def unavailable_reason() -> str | None:
    """Why CUDA kernels cannot run here (None when they can): no CUDA device for torch, or no CuPy."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        cp = _cp()
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA runtime mismatch raised by CuPy
        return f"CuPy unusable: {exc!r}"
    return None


@functools.cache
def _kernel(filename: str, name_expression: str):
    """Compile (NVRTC, cached by CuPy on disk too) one template instantiation."""
    cp = _cp()
    module = cp.RawModule(code=kernel_source(filename), options=NVRTC_OPTIONS,
                          name_expressions=(name_expression,))
    return module.get_function(name_expression)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@contextmanager
def _on_torch_stream(device: torch.device):
    """CuPy's current device and stream = torch's, so launches order with torch's work (and graphs)."""
    cp = _cp()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cp.cuda.Device(index):
        with cp.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream, index):
            yield


def _arr(t: torch.Tensor):
    """Zero-copy CuPy view of a torch tensor (half types viewed as int16: kernels take raw pointers)."""
    if t.dtype in HALF_TYPES:
        t = t.view(torch.int16)
    return _cp().from_dlpack(t)


class CupyLauncher:
    """Where the ops' kernels run: on the GPU, through CuPy, on torch's current stream.

    The ops only plan, allocate and pack arguments; a launcher executes. tests/cuda_cpu swaps in one
    that runs the same kernels on the CPU (`use_launcher`), so everything in this module but the
    two methods below is exercised without a GPU.
    """

    def launch(self, filename: str, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
        """Tensors go through DLPack; scalars must be numpy-typed (np.int32, np.int64, np.float32)."""
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with _on_torch_stream(device):
            kernel_args = tuple(_arr(a) if isinstance(a, torch.Tensor) else a for a in args)
            _kernel(filename, name)(grid, block, kernel_args)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A kernel output buffer, uninitialised: the kernels write every element the ops return."""
        return torch.empty(shape, dtype=dtype, device=device)


_launcher = CupyLauncher()


@contextmanager
def use_launcher(launcher):
    """Run this module's kernel launches and output allocations through `launcher` inside the block."""
    global _launcher
    previous, _launcher = _launcher, launcher
    try:
        yield launcher
    finally:
        _launcher = previous


def _launch(filename: str, name: str, grid, block, *args) -> None:
    _launcher.launch(filename, name, tuple(grid), tuple(block), args)


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _launcher.empty(tuple(shape), dtype, device)


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _threads(work: int, cap: int = 256) -> int:
    """Threads for `work` parallel items: a multiple of 32, at most cap."""
    return max(32, min(cap, -(-work // 32) * 32))


# ---------------------------------------------------------------- ops


def _norm_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weights stay in their dtype when it is x's or fp32 (both compiled); anything else -> fp32."""
    return weight.contiguous() if weight.dtype in (dtype, torch.float32) else weight.float().contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H], weight: [H] -> [T, H] (fp32 statistics, cast back to x.dtype)."""
    x = x.contiguous()
    weight = _norm_weight(weight, x.dtype)
    out = _empty(x.shape, x.dtype, x.device)
    tokens, hidden = x.shape
    vec = _vec_for((hidden,), x, weight, out)
    warps = norm_warps(hidden, vec)
    if tokens:
        _launch("layernorm.cu", norm_kernel_name(False, x.dtype, weight.dtype, vec, warps), (tokens,),
                (warps * 32,), out, x, weight, _i32(hidden), _f32(eps))
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual) [T, H], x + residual [T, H])."""
    x, residual = x.contiguous(), residual.to(x.dtype).contiguous()
    weight = _norm_weight(weight, x.dtype)
    out, residual_out = _empty(x.shape, x.dtype, x.device), _empty(x.shape, x.dtype, x.device)
    tokens, hidden = x.shape
    vec = _vec_for((hidden,), x, residual, weight, out, residual_out)
    warps = norm_warps(hidden, vec)
    if tokens:
        _launch("layernorm.cu", norm_kernel_name(True, x.dtype, weight.dtype, vec, warps), (tokens,),
                (warps * 32,), out, residual_out, x, residual, weight, _i32(hidden), _f32(eps))
    return out, residual_out


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64, q: [T, Hq, D], k: [T, Hk, D] (strided views allowed), cos_sin: [max_pos, D]
    fp32 -> (q_rot [T, Hq, D], k_rot [T, Hk, D]) contiguous."""
    q, k = _last_dim_dense(q), _last_dim_dense(k).to(q.dtype)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out, k_out = _empty(q.shape, q.dtype, q.device), _empty(k.shape, q.dtype, q.device)
    if tokens:
        name = f"llmserve::rotary_kernel<{CTYPE[q.dtype]}, {'true' if interleaved else 'false'}>"
        _launch("rotary.cu", name, (tokens,), (_threads(max(num_heads, num_kv_heads) * head_dim // 2),),
                q_out, k_out, q, k, positions.to(torch.int64).contiguous(), cos_sin.float().contiguous(),
                _i64(q.stride(0)), _i64(q.stride(1)), _i64(k.stride(0)), _i64(k.stride(1)),
                _i32(num_heads), _i32(num_kv_heads), _i32(head_dim))
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> silu(x[:, :I]) * x[:, I:]  [T, I]."""
    x = x.contiguous()
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = _empty((tokens, inter), x.dtype, x.device)
    vec = _vec_for((inter,), x, out)
    threads = _threads(inter // vec)
    col_chunks = -(-inter // (threads * vec))
    if tokens:
        _launch("activation.cu", f"llmserve::silu_and_mul_kernel<{CTYPE[x.dtype]}, {vec}>",
                (tokens, col_chunks), (threads,), out, x, _i32(inter))
    return out


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 linear. x: [T, K], q: [N, K] int8, scale: [N] -> x @ (q * scale[:, None]).T
    [T, N] in x.dtype. Decode-sized calls run int8_gemv.cu on the int8 weight; larger ones (prefill)
    and shapes it cannot take (K not a multiple of 16, unaligned rows) dequantize and use cuBLAS."""
    x = x.contiguous()
    tokens, k_cols = x.shape
    n_rows = q.shape[0]
    if tokens > INT8_GEMV_MAX_TOKENS or k_cols % 16 or not (_aligned16(x) and _aligned16(q)):
        return x @ (q.to(x.dtype) * scale[:, None].to(x.dtype)).t()
    out = _empty((tokens, n_rows), x.dtype, x.device)
    if tokens:
        grid = (-(-n_rows // INT8_GEMV_WARPS), -(-tokens // INT8_GEMV_TOKENS))
        _launch("int8_gemv.cu", int8_gemv_kernel_name(x.dtype), grid, (INT8_GEMV_WARPS * 32,), out, x,
                q.contiguous(), scale.float().contiguous(), _i32(tokens), _i32(n_rows), _i32(k_cols))
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D] (strided views allowed) written in place into k_cache, v_cache:
    [num_blocks, block_size, Hk, D] at flat slot slot_mapping[t]; slot -1 is skipped."""
    dtype = k_cache.dtype
    k, v = _last_dim_dense(k.to(dtype)), _last_dim_dense(v.to(dtype))
    tokens, num_kv_heads, head_dim = k.shape
    vec = vec_width(dtype, head_dim)
    if vec == 8 and not (_aligned16(k) and _aligned16(v)):
        k, v = k.contiguous(), v.contiguous()
    vec = _vec_for((head_dim,), k, v, k_cache, v_cache)  # .contiguous() keeps a misaligned dense view
    if tokens:
        _launch("kv_cache.cu", f"llmserve::write_kv_cache_kernel<{CTYPE[dtype]}, {vec}>", (tokens,),
                (_threads(num_kv_heads * head_dim // vec),), k_cache, v_cache, k, v,
                slot_mapping.to(torch.int64).contiguous(), _i64(k.stride(0)), _i64(k.stride(1)),
                _i64(v.stride(0)), _i64(v.stride(1)), _i32(num_kv_heads), _i32(head_dim))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged context; GQA, fp32 accumulation, split-K over
    PARTITION_TOKENS-long partitions for long block tables. q: [B, Hq, D], k_cache/v_cache: [num_blocks, bs, Hk, D],
    block_tables: [B, max_blocks] int32, context_lens: [B] int32 -> [B, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not decode_kernel_supports(head_dim, block_size, q.dtype) or k_cache.dtype != q.dtype:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV cache must be contiguous"
    assert _aligned16(k_cache) and _aligned16(v_cache), "KV cache must be 16-byte aligned"
    q = q.contiguous() if _aligned16(q) else q.clone(memory_format=torch.contiguous_format)  # fresh: aligned
    group = num_heads // num_kv_heads
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    max_blocks = block_tables.shape[1]
    out = _empty(q.shape, q.dtype, q.device)
    if num_seqs == 0:
        return out
    plan = plan_decode(group, max_blocks, block_size)
    parts = plan.num_partitions
    part_acc = _empty((num_seqs, num_heads, parts, head_dim) if parts > 1 else (1,), torch.float32, q.device)
    part_max = _empty((num_seqs, num_heads, parts) if parts > 1 else (1,), torch.float32, q.device)
    part_sum = _empty(part_max.shape, torch.float32, q.device)
    _launch("paged_attention.cu", decode_kernel_name(q.dtype, head_dim, block_size, plan.group_max),
            plan.grid(num_seqs, num_kv_heads), (DECODE_WARPS * 32,),
            out, part_acc, part_max, part_sum, q, k_cache, v_cache, block_tables,
            context_lens, _i32(max_blocks), _i32(num_kv_heads), _i32(group), _i32(plan.partition_blocks),
            _i32(parts), _f32(scale * math.log2(math.e)))
    if parts > 1:
        _launch("paged_attention.cu", reduce_kernel_name(q.dtype, head_dim), (num_heads, num_seqs), (head_dim,),
                out, part_acc, part_max, part_sum, context_lens, _i32(parts),
                _i32(plan.partition_blocks * block_size))
    return out


# ---------------------------------------------------------------- prefill: gather + torch SDPA


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """cache: [num_blocks, bs, Hk, D], block_table: [max_blocks] -> [context_len, Hk, D] contiguous."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-context_len // block_size)].long()
    return cache[blocks].flatten(0, 1)[:context_len]


def _prefill_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_len: int, scale: float) -> torch.Tensor:
    """q: [L, Hq, D] at context positions context_len - L .. context_len - 1 -> [L, Hq, D]."""
    q_len = q.shape[0]
    k = gather_context(k_cache, block_table, context_len).transpose(0, 1)  # [Hk, C, D]
    v = gather_context(v_cache, block_table, context_len).transpose(0, 1)
    qh = q.transpose(0, 1)  # [Hq, L, D]
    if q_len == context_len:  # plain causal: lets SDPA pick its flash kernel
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # causal with the queries at the end of the context (bottom-right aligned)
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # [L, C]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each prefill chunk over its cached context: K/V gathered contiguous per
    sequence, then torch SDPA in the cache dtype (flash / memory-efficient kernels on GPU).

    q: [T, Hq, D], block_tables: [S, max_blocks] int32, query_start_loc: [S + 1] int32,
    context_lens: [S] int32 -> [T, Hq, D]. Not graph-captured: it reads the lengths on the host.
    """
    return reference.prefill_each_sequence(_prefill_one, q, k_cache, v_cache, block_tables, query_start_loc,
                                           context_lens, scale)
