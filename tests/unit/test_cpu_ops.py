"""The CPU ops backend's C kernels (gpu_worker/ops/cpu/layer_ops.py) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.ops import reference
from gpu_worker.ops.cpu import layer_ops as cpu

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler to build the CPU kernels")


def _qkv(tokens: int, gen: torch.Generator, heads: int = 9, kv_heads: int = 3, head_dim: int = 64):
    """q, k, v as the model has them: views of one fused projection [T, (Hq + 2Hk) * D] (strided rows)."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.reshape(tokens, kv_heads, head_dim))


def test_norms_follow_the_reference_on_strided_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1200, generator=gen)[:, :576]  # row stride 1200
    residual, weight = torch.randn(7, 576, generator=gen), torch.randn(576, generator=gen)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    out, total = cpu.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_total = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(total, ref_total)  # one fp32 add, same bits
    assert not torch.equal(total, residual)  # the inputs are left as they were: a new tensor is returned


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_follows_the_reference(interleaved):
    gen = torch.Generator().manual_seed(1)
    q, k, _ = _qkv(5, gen)
    cos_sin = torch.randn(64, 64, generator=gen)
    positions = torch.tensor([0, 3, 63, 7, 7])
    q_rot, k_rot = cpu.rotary_embedding(positions, q, k, cos_sin, interleaved)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cos_sin, interleaved)
    torch.testing.assert_close(q_rot, ref_q)
    torch.testing.assert_close(k_rot, ref_k)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()


def test_write_kv_cache_matches_the_reference_and_skips_padding_slots():
    gen = torch.Generator().manual_seed(2)
    _, k, v = _qkv(4, gen)
    slots = torch.tensor([5, -1, 0, 17])
    caches = [torch.zeros(3, 8, 3, 64) for _ in range(4)]
    cpu.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, 3, 64)[[1, 2, 3, 4]].abs().sum() == 0  # only the named slots were written


def test_each_token_is_the_same_bits_alone_or_in_a_batch():
    gen = torch.Generator().manual_seed(3)
    q, k, _ = _qkv(6, gen)
    cos_sin, positions = torch.randn(16, 64, generator=gen), torch.arange(6)
    x, residual, weight = (torch.randn(6, 576, generator=gen), torch.randn(6, 576, generator=gen),
                           torch.randn(576, generator=gen))
    batch_norm, _ = cpu.fused_add_rms_norm(x, residual, weight, 1e-6)
    batch_q, batch_k = cpu.rotary_embedding(positions, q, k, cos_sin, False)
    for t in range(6):
        alone_norm, _ = cpu.fused_add_rms_norm(x[t:t + 1], residual[t:t + 1], weight, 1e-6)
        alone_q, alone_k = cpu.rotary_embedding(positions[t:t + 1], q[t:t + 1], k[t:t + 1], cos_sin, False)
        assert torch.equal(alone_norm[0], batch_norm[t])
        assert torch.equal(alone_q[0], batch_q[t]) and torch.equal(alone_k[0], batch_k[t])


def test_bf16_and_empty_inputs_take_the_reference():
    x, weight = torch.randn(3, 64).bfloat16(), torch.randn(64).bfloat16()
    assert torch.equal(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    empty = torch.zeros(0, 64)
    assert cpu.rms_norm(empty, torch.ones(64), 1e-5).shape == (0, 64)


def test_silu_and_mul_follows_the_reference_and_a_row_is_the_same_bits_in_any_batch():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 2 * 1536, generator=gen) * 4
    out = cpu.silu_and_mul(x)
    torch.testing.assert_close(out, reference.silu_and_mul(x))
    assert all(torch.equal(cpu.silu_and_mul(x[i:i + 1]), out[i:i + 1]) for i in range(9))
