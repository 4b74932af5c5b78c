"""Weight-only int8 / int4 CPU linears: close to F.linear, compact, and each row independent of the batch.

int4 runs as GGUF Q4_1 blocks on the C kernel (ops/cpu/block_linear.c) where it builds, else on
torch's int4 kernel; both are checked here, and the Q8_0 vocab head beside them. So are the
linears of a GGUF file's own blocks of every quantized type (ops/weights/gguf_weight.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops.cpu import block_linear as cpu_block_linear
from gpu_worker.ops.cpu import build as cpu_kernels
from gpu_worker.ops.cpu import kquant_linear
from gpu_worker.ops.cpu.backend import CpuBackend
from gpu_worker.ops.weights import gguf_blocks, gguf_weight, packed_linear, quantized_linear
from gpu_worker.ops.weights.gguf_weight import FileTensor
from gpu_worker.ops.weights.quantized_linear import (
    Int4Weight,
    Int8Weight,
    KQuantWeight,
    Q4_0Weight,
    Q4_1Weight,
    Q5_0Weight,
    Q5_1Weight,
    Q8_0Weight,
)
from tests.unit.gguf_random import random_blocks

FORMATS = sorted(quantized_linear.FORMATS)
needs_block_kernel = pytest.mark.skipif(cpu_block_linear.library() is None,
                                        reason="no C compiler or no AVX2/FMA/F16C for the block kernel")
# every CPU linear class, each as the format it implements
CLASSES = [Int8Weight, Int4Weight, pytest.param(Q4_1Weight, marks=needs_block_kernel),
           pytest.param(Q8_0Weight, marks=needs_block_kernel)]
# relative error against F.linear: int8 per channel keeps ~1/254 of a row's range, Q8_0 ~1/254 of a
# group's, int4 in groups of 32 ~1/30 of a group's
TOLERANCE = {Int8Weight: 0.01, Int4Weight: 0.08, Q4_1Weight: 0.08, Q8_0Weight: 0.01}


def q8_0_code_max() -> int:
    """Q8_0's largest input code in this CPU's build: 127 with VNNI, else 32767 (block_linear.c)."""
    library = cpu_block_linear.library()
    return ctypes.c_int.in_dll(library, "q8_0_code_max").value if library is not None else 32767


# the largest activation code of each C kernel's input rows (block_linear.c, kquant_linear.c)
CODE_MAX = {Q4_0Weight: 127, Q4_1Weight: 127, Q5_0Weight: 127, Q5_1Weight: 127, Q8_0Weight: q8_0_code_max(),
            KQuantWeight: 127}


def on_code_grid(x: torch.Tensor, code_max: int) -> torch.Tensor:
    """x [M, K] as a C kernel quantizes it, in float64: per block of 32, xd = max |x| / code_max and
    codes round(x / xd) (to nearest even, as the kernels' nearbyintf), each as code * xd."""
    blocks = x.view(x.shape[0], -1, 32)
    xd = blocks.abs().amax(dim=-1, keepdim=True) / code_max
    inv = torch.where(xd > 0, 1 / xd, torch.zeros_like(xd))
    return (torch.round(blocks * inv).double() * xd.double()).view(x.shape)


def q4_1_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight [n, k] as a GGUF Q4_1 file dequantizes: codes 0..15 in groups of 32, w = code * d + m,
    with d and m exact in bf16 and every group using codes 0 and 15."""
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 0.001).bfloat16().float()
    m = (-8 * d - torch.rand(n, k // 32, 1, generator=gen) * 0.01).bfloat16().float()
    return (codes * d + m).view(n, k)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_close_to_f_linear(cls, with_bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(320, 96, generator=gen) * 0.05
    b = torch.randn(320, generator=gen) if with_bias else None
    x = torch.randn(37, 96, generator=gen)
    out = cls(w)(x, b)
    assert out.dtype == torch.float32 and out.shape == (37, 320)
    ref = F.linear(x, w, b)
    rel = (out - ref).norm() / ref.norm()
    assert rel < TOLERANCE[cls], rel


def test_int4_recovers_q4_1_codes_exactly():
    """A Q4_1-dequantized weight goes through int4 without loss: the kernel then only rounds
    its bf16 activations and output."""
    gen = torch.Generator().manual_seed(3)
    w = q4_1_weight(64, 128, gen)
    x = torch.randn(5, 128, generator=gen).bfloat16()
    out = Int4Weight(w).matmul(x).float()
    ref = F.linear(x.float(), w)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=2e-2)  # bf16 output rounding only


@needs_block_kernel
def test_q4_1_blocks_hold_a_q4_1_file_exactly_and_the_kernel_follows_fp32():
    """A Q4_1-dequantized weight packs back to its own codes, d (exact in fp16) and m, so the
    block kernel differs from an fp64 GEMM of its 8-bit activation codes only by fp32 sums: ~1e-7
    relative, where a wrong code or scale is ~1e-2 and more."""
    gen = torch.Generator().manual_seed(3)
    w = q4_1_weight(64, 128, gen)
    weight = Q4_1Weight(w)
    nibbles = weight.codes.view(64, 4, 16)  # per block of 32, byte j: code j | code j+16 << 4
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
    d = weight.scales.float()[..., None]
    assert torch.equal((codes * d + weight.offsets.float().t()[..., None]).view(64, 128), w)
    x = torch.randn(5, 128, generator=gen)
    out, ref = Q4_1Weight(w)(x).double(), on_code_grid(x, 127) @ w.double().t()
    assert ((out - ref).norm() / ref.norm()) < 1e-6


@needs_block_kernel
def test_q8_0_blocks_hold_a_q8_0_file_exactly():
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (32, 4, 32), generator=gen)
    codes[..., 0] = 127  # every group uses its full range, as GGUF's quantizer leaves it
    d = (torch.rand(32, 4, 1, generator=gen) * 0.01 + 0.001).half().float()
    w = (codes * d).view(32, 128)
    weight = Q8_0Weight(w)
    # per pair of blocks (A, B), four 16-byte chunks [A 8c..8c+7, B 8c..8c+7]
    stored = weight.codes.view(torch.int8).view(32, 2, 4, 2, 8).transpose(2, 3).reshape(32, 4, 32)
    assert torch.equal(stored.long(), codes)
    assert torch.equal(weight.scales.float()[..., None], d)


@needs_block_kernel
@pytest.mark.parametrize("cls", [Q4_1Weight, Q8_0Weight])
@pytest.mark.parametrize("k", [32, 96, 576])
def test_block_kernel_follows_fp32_with_an_odd_block_count_too(cls, k):
    """The kernel takes blocks in pairs; an odd last block is paired with zeros and adds nothing."""
    gen = torch.Generator().manual_seed(6)
    w = q4_1_weight(48, k, gen) if cls is Q4_1Weight else torch.randn(48, k, generator=gen) * 0.05
    weight = cls(w)
    dequantized = weight(torch.eye(k)).t()  # the weight the kernel multiplies by, row by row
    x = torch.randn(7, k, generator=gen)
    out, ref = weight(x).double(), on_code_grid(x, CODE_MAX[cls]) @ dequantized.double().t()
    assert ((out - ref).norm() / ref.norm()) < 1e-6
    if cls is Q4_1Weight:
        torch.testing.assert_close(dequantized, w, rtol=0, atol=1e-4)


def test_int8_stores_one_byte_per_weight_and_int4_half():
    w = torch.randn(256, 128)
    assert Int8Weight(w).nbytes == 256 * 128 + 256 * 2
    assert Int4Weight(w).nbytes == 256 * 128 // 2 + (128 // 32) * 256 * 2 * 2


@pytest.mark.parametrize("cls", [Int4Weight, pytest.param(Q4_1Weight, marks=needs_block_kernel),
                                 pytest.param(Q8_0Weight, marks=needs_block_kernel)])
def test_group_formats_reject_a_width_not_a_multiple_of_32(cls):
    with pytest.raises(ValueError, match="multiple of 32"):
        cls(torch.randn(8, 40))


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("n_out,k", [(960, 576), (3072, 576), (576, 1536), (49152, 576)])
def test_rows_are_bitwise_independent_of_batch_size(cls, n_out, k):
    """Batch invariance of greedy output rests on this (SmolLM2's GEMM shapes); rows 0-3 are
    checked at every batch size, the last rows where a batch ends mid-tile too."""
    gen = torch.Generator().manual_seed(1)
    weight = cls(torch.randn(n_out, k, generator=gen) * 0.05)
    x = torch.randn(130, k, generator=gen)
    alone = [weight(x[i:i + 1]) for i in range(130)]
    for m in (1, 2, 3, 5, 16, 17, 33, 64, 65, 130):
        batch = weight(x[:m])
        for i in sorted({*range(min(m, 4)), m - 1}):
            assert torch.equal(batch[i:i + 1], alone[i]), (m, i)


@pytest.mark.parametrize("cls", [pytest.param(Q4_1Weight, marks=needs_block_kernel),
                                 pytest.param(Q8_0Weight, marks=needs_block_kernel)])
def test_block_kernel_rows_do_not_depend_on_the_thread_count(cls):
    gen = torch.Generator().manual_seed(5)
    weight = cls(torch.randn(1000, 576, generator=gen) * 0.05)
    x = torch.randn(9, 576, generator=gen)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(weight(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.skipif(not packed_linear.available(), reason="torch build without oneDNN prepacking")
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_gives_close_logits(fmt):
    config = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, context_length=64, tie_word_embeddings=True,
                         attention_bias=True)
    plain = LlamaModel(config, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(2)
    for p in plain.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    quantized = LlamaModel(config, "cpu", torch.float32)
    quantized.load_state_dict(plain.state_dict())
    assert CpuBackend().prepare_weights(quantized, fmt)
    block_kernel = cpu_block_linear.library() is not None
    layer_class = Q4_1Weight if fmt == "int4" and block_kernel else quantized_linear.FORMATS[fmt]
    assert type(quantized.layers[0].qkv_weight) is layer_class
    assert "qkv_weight" not in dict(quantized.named_parameters(recurse=False))
    if fmt == "int4" and block_kernel:  # Q8_0 head beside Q4_1 layers, as a GGUF file has them
        assert isinstance(quantized.lm_head, Q8_0Weight)
    else:
        assert quantized.lm_head.is_mkldnn  # the vocab head stays prepacked fp32

    n = 9
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_prefills=1, num_prefill_tokens=n,
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
        prefill_block_tables=torch.arange(4, dtype=torch.int32)[None],
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        decode_block_tables=torch.zeros(0, 4, dtype=torch.int32), logits_indices=torch.arange(n),
    )
    ids = torch.randint(0, 100, (n,), generator=gen)
    logits = [m(ids, torch.arange(n), meta, KVCache.allocate(config, 4, 4, torch.float32, "cpu"))
              for m in (plain, quantized)]
    rel = (logits[1] - logits[0]).norm() / logits[0].norm()
    assert rel < {"int8": 0.02, "int4": 0.15}[fmt], rel


def test_calls_of_few_rows_run_on_one_thread_unless_their_weight_is_large():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_block_linear.threads_for(1) == 1
        assert cpu_block_linear.threads_for(cpu_block_linear.SINGLE_THREAD_ROWS) == 1
        assert cpu_block_linear.threads_for(cpu_block_linear.SINGLE_THREAD_ROWS + 1) == 2
        head = 49152 * 576 * 34 // 32      # SmolLM2's Q8_0 vocabulary head, bytes
        assert cpu_block_linear.threads_for(1, 3072 * 576) == 1 and cpu_block_linear.threads_for(1, head) == 2
    finally:
        torch.set_num_threads(threads)


# ---- a GGUF file's own blocks ---------------------------------------------------------------------------

needs_kquant_kernel = pytest.mark.skipif(cpu_block_linear.library() is None or kquant_linear.library() is None,
                                         reason="no C compiler or no AVX2/FMA/F16C for the block kernels")
FILE_TYPES = [pytest.param(t, id=t.name, marks=needs_kquant_kernel) for t in gguf_blocks.QUANTIZED_TYPES]
# fp16 field scales that keep every type's weights within about +-0.3
FIELD_SCALE = {"Q4_0": 0.04, "Q4_1": 0.02, "Q5_0": 0.02, "Q5_1": 0.01, "Q8_0": 0.003, "Q2_K": 0.01, "Q3_K": 0.002,
               "Q4_K": 3e-4, "Q5_K": 1.5e-4, "Q6_K": 1e-4}


def file_tensor(ggml_type, n: int, k: int, seed: int) -> FileTensor:
    rng = np.random.default_rng(seed)
    return FileTensor(ggml_type, random_blocks(ggml_type, n, k, rng, scale=FIELD_SCALE[ggml_type.name]), k)


def widths(ggml_type) -> list[int]:
    """K types come in rows of whole super-blocks of 256; legacy ones in blocks of 32, an odd count too."""
    return [256, 768] if ggml_type in gguf_blocks.K_TYPES else [32, 96, 576]


@pytest.mark.parametrize("ggml_type", FILE_TYPES)
def test_file_blocks_run_on_the_c_kernels_and_follow_the_dequantized_weight(ggml_type):
    """Against x @ W.T in float64 with x on the kernel's code grid and W gguf's own dequantization: the
    kernels' only other rounding is fp32 sums (~1e-7 relative), so 1e-6 relative is some 5x that; a
    wrong code, scale or sub-block is ~1."""
    blocks = {gguf_blocks.T.Q4_0: Q4_0Weight, gguf_blocks.T.Q4_1: Q4_1Weight, gguf_blocks.T.Q5_0: Q5_0Weight,
              gguf_blocks.T.Q5_1: Q5_1Weight, gguf_blocks.T.Q8_0: Q8_0Weight}
    expected = blocks.get(ggml_type, KQuantWeight)
    for k in widths(ggml_type):
        t = file_tensor(ggml_type, 40, k, seed=k)
        weight = gguf_weight.cpu_weight([t])
        assert type(weight) is expected
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(k))
        ref = on_code_grid(x, CODE_MAX[expected]) @ t.dequantize().double().t()
        out = weight(x)
        assert out.dtype == torch.float32 and out.shape == (7, 40)
        assert ((out.double() - ref).norm() / ref.norm()) < 1e-6, k


@pytest.mark.parametrize("ggml_type", FILE_TYPES)
def test_file_blocks_dequantize_as_the_file_does(ggml_type):
    t = file_tensor(ggml_type, 8, widths(ggml_type)[0], seed=3)
    expect = gguf_blocks.dequantize(gguf_blocks.parts(ggml_type, t.data))
    assert np.array_equal(t.dequantize().numpy(), expect)


@needs_kquant_kernel
def test_file_blocks_take_about_the_files_bytes():
    """K types keep their codes at the type's own bits and their two-level scales: int8 sc and mn per
    sub-block, fp32 d and dmin per 256, so 1.25 bits a weight more with 16-weight sub-blocks and 0.75 with
    Q4_K's and Q5_K's 32, and Q3_K and Q6_K, whose offsets follow from their scales, 0.625 (no mn, dmin);
    the legacy types take their files' own bytes (fp16 d, and for Q4_1 and Q5_1 m, per 32)."""
    n, k = 64, 512
    bits = {gguf_blocks.T.Q4_0: 4 + 0.5, gguf_blocks.T.Q4_1: 4 + 1.0, gguf_blocks.T.Q5_0: 5 + 0.5,
            gguf_blocks.T.Q5_1: 5 + 1.0,
            **{t: gguf_blocks.BITS[t] + 1.25 for t in gguf_blocks.K_TYPES},
            gguf_blocks.T.Q3_K: 3 + 0.625, gguf_blocks.T.Q4_K: 4 + 0.75, gguf_blocks.T.Q5_K: 5 + 0.75,
            gguf_blocks.T.Q6_K: 6 + 0.625}
    for ggml_type, weight_bits in bits.items():
        assert gguf_weight.cpu_weight([file_tensor(ggml_type, n, k, 0)]).nbytes == n * k * weight_bits / 8


@needs_kquant_kernel
@pytest.mark.parametrize("ggml_type", [gguf_blocks.T.Q5_0, gguf_blocks.T.Q5_1, gguf_blocks.T.Q4_K, gguf_blocks.T.Q6_K],
                         ids=lambda t: t.name)
def test_file_block_rows_do_not_depend_on_the_batch_or_the_thread_count(ggml_type):
    weight = gguf_weight.cpu_weight([file_tensor(ggml_type, 1000, 768, seed=5)])
    x = torch.randn(70, 768, generator=torch.Generator().manual_seed(5))
    alone = [weight(x[i:i + 1]) for i in range(70)]
    for m in (2, 3, 5, 17, 70):
        batch = weight(x[:m])
        for i in sorted({*range(min(m, 4)), m - 1}):
            assert torch.equal(batch[i:i + 1], alone[i]), (m, i)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(weight(x[:9]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


@needs_kquant_kernel
def test_a_fused_weight_of_mixed_types_runs_its_parts_in_row_order():
    """Q, K and V of a K-quant mix: Q4_K, Q3_K and Q6_K rows (plus an F16 part) in one fused weight."""
    parts = [file_tensor(gguf_blocks.T.Q4_K, 64, 256, 1), file_tensor(gguf_blocks.T.Q3_K, 32, 256, 2),
             file_tensor(gguf_blocks.T.Q6_K, 32, 256, 3),
             FileTensor(gguf_blocks.T.F16, np.random.default_rng(4).standard_normal((16, 256)).astype(np.float16), 256)]
    weight = gguf_weight.cpu_weight(parts)
    assert isinstance(weight, gguf_weight.RowsWeight) and weight.out_features == 144
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    quantized_x = on_code_grid(x, CODE_MAX[KQuantWeight])  # the F16 part takes x as it is
    ref = torch.cat([(quantized_x if p.ggml_type in gguf_blocks.K_TYPES else x.double()) @ p.dequantize().double().t()
                     for p in parts], dim=1)
    assert ((weight(x).double() - ref).norm() / ref.norm()) < 1e-6
    same = gguf_weight.cpu_weight(parts[:1] * 2)  # parts of one type: one weight of their rows
    assert isinstance(same, KQuantWeight) and same.out_features == 128


@needs_kquant_kernel
def test_legacy_parts_of_two_types_run_as_two_weights_in_row_order():
    """Q4_K_M's Q5_0 Q and K beside a Q8_0 V: one Q5_0 weight of Q's and K's rows, then the Q8_0 V."""
    parts = [file_tensor(gguf_blocks.T.Q5_0, 64, 96, 1), file_tensor(gguf_blocks.T.Q5_0, 32, 96, 2),
             file_tensor(gguf_blocks.T.Q8_0, 32, 96, 3)]
    weight = gguf_weight.cpu_weight(parts)
    assert isinstance(weight, gguf_weight.RowsWeight) and weight.part_rows == [96, 32]
    assert [type(p) for p in weight.parts] == [Q5_0Weight, Q8_0Weight]
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    ref = torch.cat([on_code_grid(x, CODE_MAX[Q5_0Weight]) @ torch.cat([p.dequantize() for p in parts[:2]]).double().t(),
                     on_code_grid(x, CODE_MAX[Q8_0Weight]) @ parts[2].dequantize().double().t()], dim=1)
    assert ((weight(x).double() - ref).norm() / ref.norm()) < 1e-6


@needs_kquant_kernel
def test_a_q4_0_block_whose_offset_would_overflow_fp16_keeps_its_own_kind():
    """Q4_0's offset -8 d overflows fp16 where d > 8,188; the kernel takes it as the zero code 8 in the
    integer dot products, so no fp16 offset exists to overflow."""
    t = file_tensor(gguf_blocks.T.Q4_0, 4, 64, 7)
    t.data[0, 0:2] = np.frombuffer(np.float16(9000.0).tobytes(), dtype=np.uint8)  # row 0, block 0: d = 9000
    weight = gguf_weight.cpu_weight([t])
    assert type(weight) is Q4_0Weight
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    ref = on_code_grid(x, CODE_MAX[Q4_0Weight]) @ t.dequantize().double().t()
    assert ((weight(x).double() - ref).norm() / ref.norm()) < 1e-6


@needs_kquant_kernel
@pytest.mark.skipif(cpu_kernels.cpu_isa() == "avx2", reason="this CPU runs the AVX2 build only")
@pytest.mark.parametrize("ggml_type", [gguf_blocks.T.Q4_0, gguf_blocks.T.Q4_1, gguf_blocks.T.Q5_0, gguf_blocks.T.Q5_1,
                                       gguf_blocks.T.Q2_K, gguf_blocks.T.Q3_K, gguf_blocks.T.Q4_K, gguf_blocks.T.Q5_K,
                                       gguf_blocks.T.Q6_K], ids=lambda t: t.name)
def test_this_cpus_build_gives_the_bits_of_the_avx2_build(ggml_type, monkeypatch):
    """VNNI fuses the integer multiply-adds, not their sums, and AVX-512 masks place the same bits of a
    Q3/Q5 code: each kind on 8-bit input codes gives the same bits (Q8_0 takes 8-bit codes with VNNI,
    16-bit without, so differs)."""
    weight = gguf_weight.cpu_weight([file_tensor(ggml_type, 96, 768, seed=7)])
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(7))
    outs = {}
    for isa in (cpu_kernels.cpu_isa(), "avx2"):
        monkeypatch.setattr(cpu_kernels, "cpu_isa", lambda isa=isa: isa)
        for library in (cpu_block_linear.library, kquant_linear.library):
            library.cache_clear()
        outs[isa] = weight(x)
    for library in (cpu_block_linear.library, kquant_linear.library):
        library.cache_clear()  # the next test gets this CPU's build again
    assert torch.equal(outs["avx2"], outs[cpu_kernels.cpu_isa()])
