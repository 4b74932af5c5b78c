"""The CPU executor itself: bit-exact 16-bit conversions, and every GPU rule it must enforce
(misaligned vector access, shuffle masks, barriers, launch bounds, argument types) shown to be
reported, with probe_kernels.cu; plus the ops' alignment checks that keep the real kernels legal."""

from __future__ import annotations

from pathlib import Path

import cpu_backend as cb
import numpy as np
import pytest
import torch
from kernel_cases import ORDERS, TOL, bits, rand

from gpu_worker.ops import reference
from gpu_worker.ops.cuda import kernels
from gpu_worker.ops.cuda import ops as cuda

HERE = Path(__file__).resolve().parent
PROBES = [f"probe::{name}" for name in (
    "convert_kernel<llmserve::f16>", "convert_kernel<llmserve::bf16>", "widen_kernel<llmserve::f16>",
    "chunk_load_kernel", "mismatched_mask_kernel", "half_warp_shuffle_kernel", "divergent_barrier_kernel",
    "early_exit_barrier_kernel", "exited_lane_shuffle_kernel", "unwritten_shared_kernel", "racy_shared_kernel",
    "synced_shared_kernel", "bounded_kernel", "out_of_bounds_kernel")]


@pytest.fixture
def probe(built):
    """probe(name, grid, block, *args, order=FORWARD, seed=0): launch a probe kernel on the CPU."""

    def run(name, grid, block, *args, order=cb.Order.FORWARD, seed=0):
        launcher = cb.CpuLauncher(order, seed, kernel_dir=HERE, variants={"probe_kernels.cu": PROBES})
        launcher.launch("probe_kernels.cu", f"probe::{name}", grid, block, args)

    return run


def out32(n=64):
    return torch.full((n,), float("nan"))


# ------------------------------------------------------------------ 16-bit conversions, bit for bit


def _halfway_points(dtype, top: int) -> torch.Tensor:
    """Every finite positive pattern's value, the midpoints to the next one, and just off them (fp32)."""
    pattern = torch.arange(0, top, dtype=torch.int32)
    lo = pattern.to(torch.int16).view(dtype).float()
    hi = (pattern + 1).to(torch.int16).view(dtype).float()
    mid = lo + (hi - lo) / 2  # exact in fp32 (and no overflow)
    nudge = mid.view(torch.int32)
    points = torch.cat([lo, mid, (nudge + 1).view(torch.float32), (nudge - 1).view(torch.float32)])
    return torch.cat([points, -points, torch.tensor([0.0, -0.0, 65504.0, 65520.0, 1e38, 3.4e38, float("inf"),
                                                      float("-inf"), 1e-8, 1e-45])])


@pytest.mark.parametrize(("dtype", "ctype", "top"), [(torch.float16, "llmserve::f16", 0x7BFF),
                                                     (torch.bfloat16, "llmserve::bf16", 0x7F7F)])
def test_narrowing_matches_torch_bit_for_bit(probe, dtype, ctype, top):
    x = _halfway_points(dtype, top)
    out, back = torch.zeros(x.shape, dtype=torch.int16), out32(x.numel())
    probe(f"convert_kernel<{ctype}>", (64,), (256,), out, back, x, np.int32(x.numel()))
    assert torch.equal(out, x.to(dtype).view(torch.int16))  # round to nearest even, overflow to inf
    assert torch.equal(bits(back), bits(x.to(dtype).float()))
    nan_bits = torch.zeros(1, dtype=torch.int16)
    probe(f"convert_kernel<{ctype}>", (1,), (32,), nan_bits, out32(1), torch.tensor([float("nan")]), np.int32(1))
    assert nan_bits.item() == 0x7FFF  # cvt.rn's canonical NaN


def test_f16_widening_matches_torch_for_every_pattern(probe):
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    out = out32(patterns.numel())
    probe("widen_kernel<llmserve::f16>", (64,), (256,), out, patterns, np.int32(patterns.numel()))
    want = patterns.view(torch.float16).float()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(bits(out[~want.isnan()]), bits(want[~want.isnan()]))


# ------------------------------------------------------------------ what a GPU punishes is an error


def test_misaligned_vector_load_is_an_error(probe):
    src = rand(64, dtype=torch.float16)
    probe("chunk_load_kernel", (1,), (32,), out32(32), src, np.int32(8))  # 16 bytes in: aligned
    with pytest.raises(cb.KernelError, match=r"misaligned .* 'const struct uint4' \(needs 16-byte alignment\).*common\.cuh:\d+"):
        probe("chunk_load_kernel", (1,), (32,), out32(32), src, np.int32(1))


@pytest.mark.parametrize("order", list(cb.Order))
def test_mismatched_shuffle_masks_are_an_error(probe, order):
    with pytest.raises(cb.KernelError, match=r"mismatched masks in one warp.*(0x0000ffff.*0xffffffff|0xffffffff.*0x0000ffff)"):
        probe("mismatched_mask_kernel", (1,), (32,), out32(32), order=order)


def test_a_consistent_half_warp_shuffle_runs(probe):
    out = out32(32)
    probe("half_warp_shuffle_kernel", (1,), (32,), out)
    lanes = torch.arange(32)
    assert out.tolist() == torch.where(lanes < 16, lanes ^ 1, lanes).float().tolist()


@pytest.mark.parametrize("order", list(cb.Order))
def test_barriers_reached_from_different_places_are_an_error(probe, order):
    with pytest.raises(cb.KernelError, match=r"different places: probe_kernels\.cu:\d+ and probe_kernels\.cu:\d+"):
        probe("divergent_barrier_kernel", (2,), (64,), out32(), order=order)


@pytest.mark.parametrize("order", list(cb.Order))
def test_a_barrier_some_threads_exited_before_is_an_error(probe, order):
    with pytest.raises(cb.KernelError, match=r"__syncthreads\(\) at probe_kernels\.cu:\d+.*exited"):
        probe("early_exit_barrier_kernel", (1,), (64,), out32(), order=order)


@pytest.mark.parametrize("order", list(cb.Order))
def test_a_shuffle_naming_an_exited_lane_is_an_error(probe, order):
    with pytest.raises(cb.KernelError, match=r"__shfl_xor_sync at probe_kernels\.cu:\d+.*exited"):
        probe("exited_lane_shuffle_kernel", (1,), (32,), out32(32), order=order)


def test_more_threads_than_launch_bounds_is_an_error(probe, built):
    probe("bounded_kernel", (1,), (64,), out32())
    with pytest.raises(cb.KernelError, match=r"128 threads per block exceed __launch_bounds__\(64\)"):
        probe("bounded_kernel", (1,), (128,), out32(128))
    reduce = kernels.reduce_kernel_name(torch.float32, 64)  # a real kernel: __launch_bounds__(HEAD_DIM)
    args = (out32(), out32(), out32(), out32(), torch.ones(1, dtype=torch.int32), np.int32(1), np.int32(256))
    with pytest.raises(cb.KernelError, match=r"exceed __launch_bounds__\(64\)"):
        cb.CpuLauncher().launch("paged_attention.cu", reduce, (1, 1), (128,), args)


def test_argument_types_are_checked_against_the_kernel(built):
    reduce = kernels.reduce_kernel_name(torch.float32, 64)
    tensors = (out32(), out32(), out32(), out32())
    with pytest.raises(cb.KernelError, match=r"argument 4: kernel takes 4-byte elements, got a tensor of 8-byte"):
        cb.CpuLauncher().launch("paged_attention.cu", reduce, (1, 1), (64,),
                                (*tensors, torch.ones(1, dtype=torch.int64), np.int32(1), np.int32(256)))
    with pytest.raises(cb.KernelError, match=r"argument 5: kernel takes a 4-byte integer"):
        cb.CpuLauncher().launch("paged_attention.cu", reduce, (1, 1), (64,),
                                (*tensors, torch.ones(1, dtype=torch.int32), np.int64(1), np.int32(256)))
    with pytest.raises(cb.KernelError, match=r"takes 7 arguments, got 6"):
        cb.CpuLauncher().launch("paged_attention.cu", reduce, (1, 1), (64,),
                                (*tensors, torch.ones(1, dtype=torch.int32), np.int32(1)))


# ------------------------------------------------------------------ poisoned memory, races


def test_shared_memory_starts_as_nan(probe):
    out = torch.zeros(64)
    probe("unwritten_shared_kernel", (3,), (64,), out)
    assert out.isnan().all()


def test_a_missing_barrier_shows_as_an_order_dependent_result(probe):
    results = []
    for order, seed in ORDERS:
        out = torch.zeros(64)
        probe("racy_shared_kernel", (1,), (64,), out, order=order, seed=seed)
        results.append(out)
    assert any(not torch.equal(bits(r), bits(results[0])) for r in results[1:])
    for order, seed in ORDERS:
        out = torch.zeros(64)
        probe("synced_shared_kernel", (1,), (64,), out, order=order, seed=seed)
        assert out.tolist() == [float((i + 1) % 64) for i in range(64)]


# ------------------------------------------------------------------ the ops keep vector accesses aligned


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A dense copy of t whose data starts 4 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype)
    offset = (4 // t.element_size()) or 1
    view = flat[offset : offset + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ops_fall_back_to_scalar_access_for_misaligned_views(launch_with, dtype):
    x, res, w = rand(3, 576, dtype=dtype, seed=1), rand(3, 576, dtype=dtype, seed=2), rand(576, dtype=dtype, seed=3)
    gate_up = rand(3, 2 * 128, dtype=dtype, seed=4)
    with launch_with():
        norm = cuda.rms_norm(_misaligned(x), w, 1e-5)
        fused = cuda.fused_add_rms_norm(_misaligned(x), _misaligned(res), w, 1e-5)
        act = cuda.silu_and_mul(_misaligned(gate_up))
    torch.testing.assert_close(norm, reference.rms_norm(x, w, 1e-5), **TOL[dtype])
    torch.testing.assert_close(fused[1], reference.fused_add_rms_norm(x, res, w, 1e-5)[1], atol=0, rtol=0)
    torch.testing.assert_close(act, reference.silu_and_mul(gate_up), **TOL[dtype])


def test_kv_write_and_decode_accept_misaligned_inputs(launch_with):
    k, v = rand(5, 2, 64, dtype=torch.float16, seed=1), rand(5, 2, 64, dtype=torch.float16, seed=2)
    caches = [torch.zeros(4, 16, 2, 64, dtype=torch.float16) for _ in range(2)]
    want = [c.clone() for c in caches]
    slots = torch.tensor([3, 17, -1, 40, 63])
    reference.write_kv_cache(k, v, want[0], want[1], slots)
    q = rand(1, 4, 64, dtype=torch.float16, seed=3)
    tables, lens = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.tensor([60], dtype=torch.int32)
    with launch_with():
        cuda.write_kv_cache(_misaligned(k), _misaligned(v), caches[0], caches[1], slots)
        out = cuda.paged_decode_attention(_misaligned(q), caches[0], caches[1], tables, lens, 0.125)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    want_out = reference.paged_decode_attention(q.float(), want[0].float(), want[1].float(), tables, lens, 0.125)
    torch.testing.assert_close(out, want_out.half(), **TOL[torch.float16])
