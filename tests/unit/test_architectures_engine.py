"""The engine's guarantees hold for every architecture, not only Llama: batching and chunked prefill,
prefix-cache hits, preemption by recompute and handoff give the same tokens as an undisturbed run,
for tiny random checkpoints of each (tests/unit/tiny_models.py), with windowed layers (window 4, block
size 4) and soft-capping, on prepacked fp32 and int4 weights; a windowed group never holds more than its
window and one step's chunk, prefill included."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, make_hf_dir, transformers_logits

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.engine.speculation import SpeculationConfig
from gpu_worker.model.kv_cache import KVCache, KVLayout, kv_layout
from gpu_worker.model.loader import load_model
from gpu_worker.runner.cpu_step_layers import StepLayers

pytest.importorskip("transformers")

ARCHS = ["mistral", "qwen3", "gemma2", "gemma3", "phi3"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
# a cache that preempts yet fits the longest prompt: gemma3's blocks are pages of 1 of its 6 layers
TIGHT_BLOCKS = {"gemma3": 30}
WINDOW, BLOCK = 4, 4  # tiny_models' sliding_window; make_engine's block size
OFF = SpeculationConfig()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-archs")
    return {arch: make_hf_dir(arch, root / arch, seed=3) for arch in ARCHS}


@pytest.fixture(scope="module", params=[(a, q) for a in ARCHS for q in ("none", "int4")],
                ids=[f"{a}-{q}" for a in ARCHS for q in ("none", "int4")])
def model(request, checkpoints, tmp_path_factory):
    arch, quantization = request.param
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield load_model(checkpoints[arch], "cpu", torch.float32, quantization=quantization)
    mp.undo()


def make_engine(model, num_blocks: int = 64, budget: int = 512, caching: bool = True,
                speculation: SpeculationConfig = OFF) -> LLMEngine:
    return LLMEngine.create(model, EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=8,
                                                max_num_batched_tokens=budget, enable_prefix_caching=caching,
                                                speculation=speculation))


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (5 + 3 * i,), generator=gen).tolist() for i in range(n)]


def run(engine: LLMEngine, seq: Sequence) -> Sequence:
    engine.add(seq)
    while engine.has_work():
        engine.step()
    return seq


def test_only_plain_llama_layers_take_the_one_call_cpu_step(model):
    """Phi-3 (fused in the file, plain Llama layers once loaded) may; the rest take the per-op path."""
    assert model.config.llama_layers == (model.config.architecture == "phi3")
    if not model.config.llama_layers:
        assert StepLayers.build(model) is None


def test_batched_and_chunked_equals_each_alone(model):
    ps = prompts(4)
    alone = [make_engine(model, caching=False).generate([p], [GREEDY])[0] for p in ps]
    assert make_engine(model, budget=8, caching=False).generate(ps, [GREEDY] * 4) == alone
    assert all(len(out) == 10 for out in alone)


@pytest.mark.parametrize("budget", [512, 4], ids=["whole", "chunked"])
def test_prefix_cache_hit_gives_identical_output(model, budget):
    shared = prompts(1, seed=5)[0] * 3  # 15 tokens: 3 full blocks of 4, longer than the window
    miss = make_engine(model, caching=False).generate([shared + [7, 8]], [GREEDY])[0]
    engine = make_engine(model, budget=budget)
    engine.generate([shared + [1, 2, 3]], [GREEDY])
    seq = run(engine, Sequence(shared + [7, 8], GREEDY))
    assert (seq.num_cached_prompt_tokens, seq.output_token_ids) == (12, miss)


def test_preemption_and_handoff_resume_with_the_same_output(model):
    ps = prompts(5, seed=3)
    sampled = [SamplingParams(temperature=0.8, seed=100 + i, max_new_tokens=14) for i in range(5)]
    roomy = make_engine(model).generate(ps, sampled)
    tight_blocks = TIGHT_BLOCKS.get(model.config.architecture, 12)
    tight = make_engine(model, num_blocks=tight_blocks)
    assert tight.generate(ps, sampled) == roomy
    assert tight.block_manager.num_free_blocks == tight_blocks
    # with every layer windowed (mistral) a sequence holds <= 2 blocks and the tight cache never runs short
    if None in kv_layout(model.config).windows:
        assert tight.scheduler.num_preemptions > 0
    seq = run(make_engine(model), Sequence(ps[0], sampled[0], prior_output_ids=roomy[0][:6]))  # another worker's 6
    assert roomy[0][:6] + seq.output_token_ids == roomy[0]
    chunked = make_engine(model, num_blocks=tight_blocks, budget=4)   # chunked prefills, preempted mid-prompt too
    assert chunked.generate(ps, sampled) == roomy
    assert chunked.block_manager.num_free_blocks == tight_blocks
    if None in kv_layout(model.config).windows:
        assert chunked.scheduler.num_preemptions > 0


def test_drafted_decoding_gives_the_same_output(model):
    """Prompt-lookup drafts (gpu_worker/engine/speculation.py) verified as chunks over windowed
    layers and soft caps: the same tokens, greedy and sampled, and a window group still holds
    no more than its window and one step's chunk."""
    every_token = list(range(3, VOCAB))       # with 1-grams looked up, every step has a draft
    ps = [every_token + p for p in prompts(3, seed=6)]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=9, max_new_tokens=10), GREEDY]
    plain = [make_engine(model, num_blocks=256).generate([p], [sp])[0] for p, sp in zip(ps, params)]
    drafting = make_engine(model, num_blocks=256, speculation=SpeculationConfig(num_tokens=4, min_ngram=1))
    assert [drafting.generate([p], [sp])[0] for p, sp in zip(ps, params)] == plain
    assert all(len(out) == 10 for out in plain) and drafting.counters.draft_tokens > 0
    assert drafting.block_manager.num_free_blocks == 256


def test_sliding_layers_hold_no_more_blocks_than_their_window(model):
    """Generating far past the window, each windowed group of a sequence holds at most
    ceil(window / block) + 1 blocks after every step, and the tokens equal those of a cache that
    keeps every block of every layer (one group, nothing given back)."""
    layout = kv_layout(model.config)
    windowed = [g for g, w in enumerate(layout.windows) if w is not None]
    if not windowed:
        pytest.skip("no sliding-window layers")
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    prompt = prompts(1, seed=7)[0] * 2  # 10 tokens, past the window already
    config = EngineConfig(num_blocks=64, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=512)
    keep_all = LLMEngine(model, KVCache.allocate(model.config, 64, BLOCK, torch.float32, "cpu",
                                                 KVLayout.single(model.config.num_layers)), config)
    engine = make_engine(model)
    seq = Sequence(prompt, params)
    engine.add(seq)
    held = []
    while engine.has_work():
        engine.step()
        if engine.block_manager.has_blocks(seq):
            held.append(max(engine.block_manager.num_held_blocks(seq, g) for g in windowed))
    assert len(held) == params.max_new_tokens - 1  # the last step frees the sequence
    assert max(held) <= -(-WINDOW // BLOCK) + 1
    assert engine.block_manager.num_free_blocks == 64
    assert seq.output_token_ids == keep_all.generate([prompt], [params])[0]


def test_a_chunked_prefill_past_the_window_holds_window_plus_one_chunk(model, checkpoints):
    """A 40-token prompt (10 blocks; window 4) prefilled in chunks of 4 in a cache that holds the whole
    context in the full groups but only window + one chunk in each windowed group (not the prompt
    in every group: that would not fit): no preemption, every windowed group of the sequence holds
    at most ceil((window - 1 + chunk) / block) + 1 blocks after each step, and the greedy tokens equal
    those of a cache keeping every block and, unquantized, transformers' argmax over the same ids."""
    layout = kv_layout(model.config)
    windowed = [g for g, w in enumerate(layout.windows) if w is not None]
    if not windowed:
        pytest.skip("no sliding-window layers")
    chunk, prompt = 4, prompts(1, seed=11)[0] * 8  # 40 tokens
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    span = -(-(WINDOW - 1 + chunk) // BLOCK) + 1
    full_groups = len(layout.windows) - len(windowed)
    num_blocks = full_groups * -(-(len(prompt) + 4) // BLOCK) + len(windowed) * span
    assert num_blocks < len(layout.windows) * -(-len(prompt) // BLOCK)  # the old admission would not fit
    engine = make_engine(model, num_blocks=num_blocks, budget=chunk, caching=False)
    seq = Sequence(prompt, params)
    engine.add(seq)
    held = []
    while engine.has_work():
        engine.step()
        if engine.block_manager.has_blocks(seq):
            held.append(max(engine.block_manager.num_held_blocks(seq, g) for g in windowed))
    assert (seq.failure, engine.scheduler.num_preemptions, len(seq.output_token_ids)) == (None, 0, 4)
    assert len(held) == len(prompt) // chunk + 2 and max(held) <= span
    config = EngineConfig(num_blocks=64, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=512)
    keep_all = LLMEngine(model, KVCache.allocate(model.config, 64, BLOCK, torch.float32, "cpu",
                                                 KVLayout.single(model.config.num_layers)), config)
    assert seq.output_token_ids == keep_all.generate([prompt], [params])[0]
    if model.weight_format == "f32":
        arch = model.config.architecture
        logits = transformers_logits(checkpoints[arch], prompt + seq.output_token_ids[:-1])
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == seq.output_token_ids
