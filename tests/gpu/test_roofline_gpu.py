"""The roofline meter on a GPU (gpu_worker/roofline.py): the probe times device-to-device copies with CUDA
events, and a bf16 model's weights and KV count at two bytes an element."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.ops.cuda import ops as cuda
from gpu_worker.roofline import KVFootprint, probe_bandwidth, weight_bytes

REASON = cuda.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no GPU run: {REASON}")]

CONFIG = ModelConfig(vocab_size=512, hidden_size=192, intermediate_size=512, num_layers=3, num_heads=3,
                     num_kv_heads=1, head_dim=64, context_length=512, tie_word_embeddings=False)


def test_the_probe_copies_device_to_device():
    probe = probe_bandwidth("cuda")
    print(f"device copy bandwidth: {probe.gbps:.0f} GB/s over {probe.buffer_bytes / 2**20:.0f} MiB "
          f"({probe.device}, best of {probe.repeats}, {probe.seconds:.3f} s)")
    assert probe.kind == "copy" and probe.gbps > 0 and probe.buffer_bytes >= 256 * 2**20


def test_bf16_weights_and_kv_count_two_bytes_an_element():
    model = LlamaModel(CONFIG, device="cuda", dtype=torch.bfloat16, lm_head_dtype=torch.bfloat16)
    c = CONFIG
    gemms = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size + 3 * c.intermediate_size * c.hidden_size
    norms = 2 * c.hidden_size * c.num_layers + c.hidden_size
    assert weight_bytes(model) == 2 * (c.num_layers * gemms + norms + c.vocab_size * c.hidden_size)
    kv = KVFootprint.of(c, torch.bfloat16)
    assert kv.span_bytes(0, 10) == c.num_layers * 10 * 2 * c.num_kv_heads * c.head_dim * 2
