"""All layers of a CPU step in one C call (runner/cpu_step_layers.py over ops/cpu/step_layers.c) against
the Python path over the same kernels: the same logits, bit for bit, and the models it leaves alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel
from gpu_worker.ops.cpu import block_linear as cpu_block_linear
from gpu_worker.ops.cpu import build, kquant_linear, layer_ops, paged_attention, uniform
from gpu_worker.ops.cpu import step_layers as cpu_step_layers
from gpu_worker.ops.cpu.backend import CpuBackend
from gpu_worker.runner.cpu_step_layers import StepLayers

pytestmark = pytest.mark.skipif(cpu_step_layers.library() is None,
                                reason="no C compiler (or no AVX2) to build the CPU kernels")
CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, context_length=256, tie_word_embeddings=True)


def make_model(quantization: str = "int4", config: ModelConfig = CONFIG) -> LlamaModel:
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                     else 0.2 * torch.randn(p.shape, generator=gen))
    assert CpuBackend().prepare_weights(model, quantization)
    return model


def record_logits(engine: LLMEngine, in_c: bool) -> list[torch.Tensor]:
    """The logits of every step `engine` runs from now on, with its runner's C step kept (in_c) or dropped."""
    seen: list[torch.Tensor] = []
    runner = engine.runner
    forward = runner.forward
    assert runner.step_layers is not None
    if not in_c:
        runner.step_layers = None

    def recorded(*args):
        seen.append(forward(*args).clone())
        return seen[-1]

    runner.forward = recorded
    return seen


def logits_of_every_step(model: LlamaModel, prompts: list[list[int]], in_c: bool) -> list[torch.Tensor]:
    """Greedy-decode the prompts (admitted together, so steps after the first are decode-only)."""
    engine = LLMEngine.create(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                                  max_num_batched_tokens=512, enable_prefix_caching=False))
    seen = record_logits(engine, in_c)
    engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)] * len(prompts))
    return seen


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request, monkeypatch):
    monkeypatch.setattr(cpu_block_linear, "SINGLE_THREAD_ROWS", 0)  # every call on the threads asked for
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_steps_give_the_python_paths_logits_bit_for_bit(monkeypatch, threads):
    model = make_model()
    calls = []
    call = StepLayers.__call__
    monkeypatch.setattr(StepLayers, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or call(self, *a))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 9, 17)]  # 1 to 5 cache blocks
    in_c = logits_of_every_step(model, prompts, in_c=True)
    assert calls == [3 + 9 + 17] + [3] * 9  # the prefill step and every decode step ran in C

    in_python = logits_of_every_step(model, prompts, in_c=False)
    assert calls == [3 + 9 + 17] + [3] * 9  # none more
    assert len(in_c) == len(in_python) == 10
    assert all(torch.equal(a, b) for a, b in zip(in_c, in_python))


@pytest.mark.skipif(build.cpu_isa() == "avx2", reason="this CPU runs the AVX2 build only")
def test_this_cpus_build_gives_the_avx2_builds_layers(monkeypatch):
    """A model's output must not hang on which variant of the kernels a machine runs: the reductions
    the compiler vectorizes (norms, attention's dot products) keep the AVX2 build's 8 lanes, so the
    layers of a prefill step give the same bits (the head differs by design: its Q8_0 input codes
    are 8-bit with VNNI, 16-bit without)."""
    model = make_model()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 19)]
    libraries = [module.library for module in (cpu_step_layers, cpu_block_linear, kquant_linear, layer_ops,
                                               paged_attention, uniform)]
    call = StepLayers.__call__
    layers = {}
    for isa in (build.cpu_isa(), "avx2"):
        monkeypatch.setattr(build, "cpu_isa", lambda isa=isa: isa)
        for library in libraries:
            library.cache_clear()
        seen = layers[isa] = []
        monkeypatch.setattr(StepLayers, "__call__", lambda self, *a, seen=seen: seen.append(call(self, *a)) or seen[-1])
        logits_of_every_step(model, prompts, in_c=True)
    monkeypatch.undo()
    for library in libraries:
        library.cache_clear()  # the next test gets this CPU's build again
    (out, residual), (avx2_out, avx2_residual) = (steps[0] for steps in layers.values())
    assert out.shape[0] == 5 + 19 and torch.equal(out, avx2_out) and torch.equal(residual, avx2_residual)


def test_chunked_prefills_prefix_hits_and_mixed_steps_give_the_python_paths_bits(monkeypatch, threads):
    """Prompts arriving while others decode, prefills cut into chunks of a small token budget and a
    prompt whose first blocks come from the prefix cache: every step, prefill tokens beside decodes,
    runs in C and gives the Python path's logits bit for bit."""
    model = make_model()
    calls = []
    call = StepLayers.__call__
    monkeypatch.setattr(StepLayers, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or call(self, *a))
    gen = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (13, 6))
    arrivals = {0: [first], 2: [second], 4: [first[:9] + second]}  # step -> prompts added before it

    def run(in_c: bool) -> list[torch.Tensor]:
        engine = LLMEngine.create(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                                      max_num_batched_tokens=8, enable_prefix_caching=True))
        seen = record_logits(engine, in_c)
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        step = 0
        while step in arrivals or engine.has_work():
            for prompt in arrivals.get(step, []):
                engine.add(Sequence(prompt, params))
            engine.step()
            step += 1
        return seen

    in_c = run(in_c=True)
    assert len(calls) == len(in_c) and any(t > 3 for t in calls)  # every step in C, prefill chunks among them
    in_python = run(in_c=False)
    assert len(calls) == len(in_c)  # none more
    assert len(in_c) == len(in_python)
    assert all(torch.equal(a, b) for a, b in zip(in_c, in_python))


@pytest.mark.parametrize("case", ["fp32 weights", "int8 weights", "qkv bias"])
def test_models_it_does_not_apply_to_keep_the_python_path(case):
    if case == "qkv bias":
        model = make_model("int4", dataclasses.replace(CONFIG, attention_bias=True))
    else:
        model = make_model("none" if case == "fp32 weights" else "int8")
    assert StepLayers.build(model) is None
