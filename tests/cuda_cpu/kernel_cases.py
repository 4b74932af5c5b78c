"""Inputs, oracles and the order check shared by the CPU-executed kernel tests (CPU tensors,
the same constructions and tolerances as tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

from collections.abc import Callable

import cpu_backend as cb
import torch

DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: dict(atol=5e-3, rtol=5e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float32: dict(atol=1e-5, rtol=1e-5)}
# Thread and block orders every kernel must give the same bits under (a difference is a race).
ORDERS = [(cb.Order.FORWARD, 0), (cb.Order.REVERSE, 0), (cb.Order.RANDOM, 1), (cb.Order.RANDOM, 2)]


def rand(*shape, dtype, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def paged_batch(lens, heads, kv_heads, dim, dtype, block_size=16, seed=0, extra_blocks=0):
    """q [B, Hq, D], shuffled paged caches holding `lens` tokens per sequence, block tables
    [B, max_blocks + extra_blocks] (extra columns point at block 0), lengths [B]."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 7
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    tables = torch.cat([tables, torch.zeros(len(lens), extra_blocks, dtype=torch.int32)], dim=1)
    k_cache = rand(num_blocks, block_size, kv_heads, dim, dtype=dtype, seed=seed + 1)
    v_cache = rand(num_blocks, block_size, kv_heads, dim, dtype=dtype, seed=seed + 2)
    q = rand(len(lens), heads, dim, dtype=dtype, seed=seed + 3)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def fp32_oracle(op, q, k_cache, v_cache, *args):
    """The reference op on fp32 copies, cast back: the kernels accumulate in fp32 too."""
    return op(q.float(), k_cache.float(), v_cache.float(), *args).to(q.dtype)


def ragged(n, lo, hi, seed) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern (so -0.0 != 0.0 and NaNs compare), as an integer tensor."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits_in_every_order(launch_with, fn: Callable[[], object]) -> object:
    """fn() under each of ORDERS; asserts every result is bit-identical, returns the first."""
    results = []
    for order, seed in ORDERS:
        with launch_with(order, seed):
            out = fn()
        results.append(out if isinstance(out, tuple) else (out,))
    for (order, seed), result in zip(ORDERS[1:], results[1:]):
        for want, got in zip(results[0], result):
            assert torch.equal(bits(got), bits(want)), f"result differs in {order.name} order (seed {seed}): a race"
    first = results[0]
    return first if len(first) > 1 else first[0]
