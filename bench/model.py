"""Model-side figures on CPU: GGUF first load (dequantize + cache write) vs cached load, and the
time of one batched forward for a few step shapes, in bf16 and fp32.

    .venv/bin/python -m bench.model                 # default model, 2 threads
    .venv/bin/python -m bench.model --threads 1 --model path/to/model.gguf

Writes bench/results/model.json. Figures depend heavily on how busy the machine is.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.loader import load_model
from gpu_worker.model.metadata import AttentionMetadata
from llmserve.catalog import model_store

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
I32 = torch.int32
# (decoding sequences, their context length, prefill tokens of one new sequence)
SHAPES = [(1, 256, 0), (8, 256, 0), (32, 512, 0), (0, 0, 256), (16, 256, 128)]


def step(num_decodes: int, context: int, prefill: int, num_blocks: int):
    """input_ids, positions, metadata of one step; decodes read shuffled blocks, writes are skipped."""
    per_seq = -(-context // BLOCK)
    decode_tables = (torch.randperm(num_blocks - 64)[: num_decodes * per_seq] + 64).view(num_decodes, per_seq)
    prefill_tables = torch.arange(max(1, -(-prefill // BLOCK)))[None] if prefill else torch.zeros(0, 1)
    meta = AttentionMetadata(
        slot_mapping=torch.cat([torch.arange(prefill), torch.full((num_decodes,), -1)]),
        num_prefills=int(prefill > 0), num_prefill_tokens=prefill,
        prefill_query_start_loc=torch.tensor([0, prefill] if prefill else [0], dtype=I32),
        prefill_context_lens=torch.tensor([prefill] if prefill else [], dtype=I32),
        prefill_block_tables=prefill_tables.to(I32),
        decode_context_lens=torch.full((num_decodes,), context, dtype=I32),
        decode_block_tables=decode_tables.to(I32),
        logits_indices=torch.tensor(([prefill - 1] if prefill else []) + [prefill + i for i in range(num_decodes)]),
    )
    positions = torch.cat([torch.arange(prefill), torch.full((num_decodes,), max(context - 1, 0))])
    return torch.randint(0, 1000, (prefill + num_decodes,)), positions, meta


def forward_ms(model: LlamaModel, cache: KVCache, shape, repeats: int = 3) -> float:
    ids, positions, meta = step(*shape, cache.num_blocks)
    model(ids, positions, meta, cache)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids, positions, meta, cache)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def timed_load(path: Path, dtype: torch.dtype) -> tuple[LlamaModel, float]:
    start = time.perf_counter()
    model = load_model(path, "cpu", dtype)
    return model, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=model_store.DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = model_store.resolve(args.model)
    os.environ["LLMSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmserve-bench-")  # force a real first load
    result = {"model": str(path), "threads": args.threads, "forward_ms": []}
    _, result["gguf_first_load_s"] = timed_load(path, torch.bfloat16)
    _, result["cached_load_s"] = timed_load(path, torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = timed_load(path, dtype)
        cache = KVCache.allocate(model.config, 2048, BLOCK, dtype, "cpu")
        for shape in SHAPES:
            ms = forward_ms(model, cache, shape)
            result["forward_ms"].append({"dtype": str(dtype).removeprefix("torch."), "decodes": shape[0],
                                         "context": shape[1], "prefill_tokens": shape[2], "ms": round(ms, 1)})
            print(result["forward_ms"][-1])
    print(f"first load {result['gguf_first_load_s']:.2f}s, cached load {result['cached_load_s']:.2f}s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "model.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
