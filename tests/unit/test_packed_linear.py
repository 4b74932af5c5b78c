"""oneDNN-prepacked CPU linear: same values as F.linear, and each row independent of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.metadata import AttentionMetadata
from gpu_worker.ops.cpu.backend import CpuBackend
from gpu_worker.ops.weights import packed_linear

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch build without oneDNN prepacking")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(dtype, with_bias):
    if not packed_linear.available(dtype):
        pytest.skip(f"this CPU cannot prepack {dtype}")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=gen).to(dtype)
    b = torch.randn(300, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(37, 96, generator=gen).to(dtype)
    packed = packed_linear.pack(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(packed_linear.linear(x, packed, b), F.linear(x, w, b), rtol=tol, atol=tol * 10)


def test_plain_weight_falls_through_to_f_linear():
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(packed_linear.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("n_out,k", [(960, 576), (3072, 576), (576, 1536), (49152, 576)])
def test_rows_are_bitwise_independent_of_batch_size(n_out, k):
    """What batch invariance of greedy output rests on: row i of x @ W.T is the same bits
    whether computed alone, in a decode batch or in a prefill chunk (SmolLM2's GEMM shapes)."""
    gen = torch.Generator().manual_seed(1)
    packed = packed_linear.pack(torch.randn(n_out, k, generator=gen))
    x = torch.randn(512, k, generator=gen)
    alone = [packed_linear.linear(x[i:i + 1], packed) for i in range(4)]
    for m in (1, 2, 3, 7, 16, 17, 33, 512):
        batch = packed_linear.linear(x[:m], packed)
        for i in range(min(m, 4)):
            assert torch.equal(batch[i:i + 1], alone[i]), (m, i)


def test_prepacked_model_gives_the_same_logits():
    config = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, context_length=64, tie_word_embeddings=True,
                         attention_bias=True)
    plain = LlamaModel(config, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(2)
    for p in plain.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    packed = LlamaModel(config, "cpu", torch.float32)
    packed.load_state_dict(plain.state_dict())
    assert CpuBackend().prepare_weights(packed, "none")
    assert packed.layers[0].qkv_weight.is_mkldnn and packed.lm_head.is_mkldnn
    assert not packed.embed.is_mkldnn  # the embedding lookup keeps the plain table

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
              for m in (plain, packed)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
