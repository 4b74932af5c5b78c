"""All layers of a decode-only CPU step in one C call (ops/cpu_decode_layers.py) against the
Python path over the same kernels: the same logits, bit for bit, and the cases it leaves alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.ops import cpu_block_linear, cpu_decode_layers

pytestmark = pytest.mark.skipif(cpu_decode_layers.library() is None,
                                reason="no C compiler (or no AVX2) to build the CPU kernels")
CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, context_length=256, tie_word_embeddings=True)


def make_model(quantization: str = "int4", config: ModelConfig = CONFIG) -> LlamaModel:
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                     else 0.2 * torch.randn(p.shape, generator=gen))
    assert model.prepack_for_cpu(quantization)
    return model


def logits_of_every_step(model: LlamaModel, monkeypatch, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Greedy-decode the prompts (admitted together, so steps after the first are decode-only)."""
    seen: list[torch.Tensor] = []
    forward = model.forward

    def recorded(*args):
        seen.append(forward(*args).clone())
        return seen[-1]

    monkeypatch.setattr(model, "forward", recorded)
    engine = LLMEngine.create(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                                  max_num_batched_tokens=512, enable_prefix_caching=False))
    engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)] * len(prompts))
    monkeypatch.setattr(model, "forward", forward)
    return seen


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request, monkeypatch):
    monkeypatch.setattr(cpu_block_linear, "SINGLE_THREAD_ROWS", 0)  # every call on the threads asked for
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_decode_steps_give_the_python_paths_logits_bit_for_bit(monkeypatch, threads):
    model = make_model()
    assert model.cpu_decode is not None
    calls = []
    call = cpu_decode_layers.DecodeLayers.__call__
    monkeypatch.setattr(cpu_decode_layers.DecodeLayers, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or call(self, *a))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 9, 17)]  # 1 to 5 cache blocks
    in_c = logits_of_every_step(model, monkeypatch, prompts)
    assert calls and set(calls) == {3}  # every decode step, with the three sequences, ran in C

    kept, model.cpu_decode = model.cpu_decode, None
    in_python = logits_of_every_step(model, monkeypatch, prompts)
    model.cpu_decode = kept
    assert len(in_c) == len(in_python) == 10
    assert all(torch.equal(a, b) for a, b in zip(in_c, in_python))


def test_steps_with_a_prefill_take_the_python_path(monkeypatch):
    model = make_model()
    calls = []
    call = cpu_decode_layers.DecodeLayers.__call__
    monkeypatch.setattr(cpu_decode_layers.DecodeLayers, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or call(self, *a))
    engine = LLMEngine.create(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                                  max_num_batched_tokens=512, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    engine.generate([[1, 2, 3]], [params])
    assert len(calls) == 3  # the prefill step did not, the three decodes did


@pytest.mark.parametrize("case", ["fp32 weights", "int8 weights", "qkv bias"])
def test_models_it_does_not_apply_to_keep_the_python_path(case):
    if case == "qkv bias":
        model = make_model("int4", dataclasses.replace(CONFIG, attention_bias=True))
    else:
        model = make_model("none" if case == "fp32 weights" else "int8")
    assert model.cpu_decode is None
