"""Scheduling bench, in-process part (CPU, seconds; bench/scheduling.py runs the real stack):
preemptive priority on the engine, token fairness on the fair queue, each beside the same run
with the feature off.

    PYTHONPATH=$PWD .venv/bin/python bench/scheduling_engine.py [--lows 8] [--low-tokens 64]

  * HIGH TTFT under a LOW flood: `--lows` LOW sequences of `--low-tokens` new tokens fill the
    engine (max_num_seqs = --lows, a tiny random Llama); after 2 decode steps a HIGH request
    arrives; steps and seconds until its first token, with priority preemption on and off.
    (32 LOWs x 512 tokens on the real stack: bench/scheduling.py.)
  * Jain's fairness index of two backlogged tenants' tokens (2,000- vs 50-token prompts, the
    same number of requests each) served by FairQueue in 60 batches of 8, against request
    round-robin (one request per tenant in turn).
Prints the figures.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from batcher.fair_queue import FairQueue, Held  # noqa: E402
from gpu_worker.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from gpu_worker.engine.sequence import SamplingParams, Sequence  # noqa: E402
from gpu_worker.model.config import ModelConfig  # noqa: E402
from gpu_worker.model.llama import LlamaModel  # noqa: E402
from llmserve.v1 import inference_pb2 as pb  # noqa: E402
from llmserve.v1 import queue_pb2  # noqa: E402

PROMPTS = {"long": 2000, "short": 50}
MAX_NEW = 16


def tiny_model() -> LlamaModel:
    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, context_length=1024, tie_word_embeddings=True)
    model = LlamaModel(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.2)
    return model


def high_ttft(model: LlamaModel, lows: int, low_tokens: int, preemption: bool) -> tuple[int, float]:
    """(steps, seconds) from the HIGH request's arrival to its first token."""
    config = EngineConfig(num_blocks=lows * (low_tokens // 16 + 4) + 16, block_size=16, max_num_seqs=lows,
                          priority_preemption=preemption)
    engine = LLMEngine.create(model, config)
    for i in range(lows):
        engine.add(Sequence([1 + i] * 32, SamplingParams(temperature=0.0, max_new_tokens=low_tokens,
                                                         ignore_eos=True), priority=pb.PRIORITY_LOW))
    for _ in range(2):
        engine.step()
    high = Sequence([7] * 32, SamplingParams(temperature=0.0, max_new_tokens=4), priority=pb.PRIORITY_HIGH)
    engine.add(high)
    start, steps = time.perf_counter(), 0
    while not high.output_token_ids:
        engine.step()
        steps += 1
    return steps, time.perf_counter() - start


def backlog(n: int) -> list[Held]:
    return [Held(f"s-{tenant}", f"{tenant}-{i}", queue_pb2.WorkItem(
                request_id=f"{tenant}{i}", tenant=tenant, priority=pb.PRIORITY_NORMAL,
                prompt_token_ids=[0] * size, sampling=queue_pb2.ResolvedSampling(max_new_tokens=MAX_NEW)), 0.0)
            for tenant, size in PROMPTS.items() for i in range(n)]


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def fair_queue_tokens(batches: int, per_batch: int) -> dict[str, int]:
    q = FairQueue()
    q.extend(backlog(batches * per_batch))
    served = dict.fromkeys(PROMPTS, 0)
    for _ in range(batches):
        taken = itertools.count()
        for held in q.take(lambda _h, c=taken: next(c) < per_batch):
            served[held.item.tenant] += held.prompt_tokens + MAX_NEW
    return served


def round_robin_tokens(batches: int, per_batch: int) -> dict[str, int]:
    """Request round-robin between two backlogged tenants: each gets half the requests."""
    requests = batches * per_batch // len(PROMPTS)
    return {tenant: requests * (size + MAX_NEW) for tenant, size in PROMPTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lows", type=int, default=8)
    parser.add_argument("--low-tokens", type=int, default=64)
    args = parser.parse_args()
    model = tiny_model()
    print(f"HIGH TTFT with {args.lows} LOW x {args.low_tokens} tokens running")
    for preemption in (True, False):
        steps, seconds = high_ttft(model, args.lows, args.low_tokens, preemption)
        print(f"  preemption {'on ' if preemption else 'off'}: {steps:4d} steps  {seconds * 1000:8.1f} ms")
    print("two backlogged tenants, 2,000- vs 50-token prompts, 60 batches of 8")
    for name, served in (("token-fair", fair_queue_tokens(60, 8)), ("round-robin", round_robin_tokens(60, 8))):
        print(f"  {name:11s}: tokens {served}  Jain {jain(list(map(float, served.values()))):.3f}")


if __name__ == "__main__":
    main()
