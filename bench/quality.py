"""Quality of each CPU weight format against fp32, on the real model:

- greedy agreement: a fixed set of 60 chat prompts, 32 greedy new tokens each; the share of
  prompts whose 32 tokens equal fp32's exactly, and the mean length of the common prefix;
- perplexity of the fixed text bench/data/perplexity.txt (one prefill, every position scored), or
  with `--ctx N` as llama.cpp's `llama-perplexity -c N` scores it: the text in chunks of N tokens,
  each its own prefill, the second half of each chunk scored.

    .venv/bin/python -m bench.quality                   # none (fp32), int8, int4
    .venv/bin/python -m bench.quality --formats none,int4
    # a GGUF in its own formats (auto), against llama-perplexity -c 128 on the same file and text:
    .venv/bin/python -m bench.quality --model FILE.gguf --formats auto --ctx 128 --no-greedy
    # the same, with llama-perplexity run by this bench on the same file, text and context
    .venv/bin/python -m bench.quality --model FILE.gguf --formats auto --ctx 512 --no-greedy \
        --text bench/data/gpl-3.0.txt --llama-perplexity PATH/llama-perplexity \
        --output bench/results/quality/FILE.json

bench/data/gpl-3.0.txt (the GPL's text, 7,639 SmolLM2 tokens: 14 chunks of 512) is long enough for
a figure to compare at 1 %; perplexity.txt (415 tokens) scores only 189 at -c 128.
Format `auto` is what the worker runs by default: a quantized GGUF in its own formats
(gpu_worker/ops/weights/gguf_weight.py). Writes bench/results/quality.json, or with --output that file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.openai_standard import cmake_options, machine_info, model_identity
from gpu_worker.config import WEIGHT_FORMATS
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams
from gpu_worker.model.kv_cache import KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.loader import load_model
from gpu_worker.model.metadata import AttentionMetadata
from llmserve.catalog import model_store
from tokenizer_svc.loader import load_tokenizer

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 32
BLOCK = 16
PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in one paragraph.",
    "Write a haiku about autumn.", "How do vaccines work?", "What is 17 times 23?",
    "Give me three tips for better sleep.", "Translate 'good morning' into Spanish.",
    "What causes the seasons on Earth?", "Summarize the plot of Romeo and Juliet.",
    "What is a prime number?", "Write a Python function that reverses a string.",
    "Why is the sky blue?", "Name five animals that live in the ocean.",
    "What is the difference between weather and climate?", "How does a refrigerator keep food cold?",
    "Describe the water cycle.", "What is machine learning?", "Tell me a short joke.",
    "What are the benefits of regular exercise?", "How many continents are there? Name them.",
    "Explain what a black hole is.", "Write a limerick about a cat.", "What is the boiling point of water?",
    "How do I make a cup of tea?", "What is the Pythagorean theorem?", "Who wrote Pride and Prejudice?",
    "Explain recursion to a beginner.", "What is inflation in economics?", "List three renewable energy sources.",
    "How does the internet work, briefly?", "What is DNA?", "Give a synonym for 'happy'.",
    "Why do leaves change color in the fall?", "What is the largest planet in the solar system?",
    "Write a two-sentence story about a robot.", "How do airplanes stay in the air?",
    "What is a noun? Give examples.", "Explain the rules of chess in brief.", "What is gravity?",
    "Suggest a name for a pet goldfish.", "What is the function of the heart?",
    "How do bees make honey?", "What is an atom made of?", "Write a SQL query that counts rows in a table.",
    "What is the speed of light?", "Explain supply and demand.", "What is a volcano?",
    "Give me a recipe for pancakes.", "What does a CPU do?", "Why is recycling important?",
    "What is the meaning of 'carpe diem'?", "How do I convert Celsius to Fahrenheit?",
    "What is democracy?", "Describe a rainbow to someone who cannot see.", "What is a verb?",
    "How do plants grow from seeds?", "Write a thank-you note to a teacher.", "What is an ecosystem?",
    "Why do we have day and night?", "What is the tallest mountain in the world?",
]


def greedy_outputs(model: LlamaModel, prompts: list[list[int]]) -> list[list[int]]:
    """NEW_TOKENS greedy tokens for every prompt, all in one engine (batching does not change them)."""
    blocks = len(prompts) * (-(-(max(map(len, prompts)) + NEW_TOKENS) // BLOCK)) + 8
    engine = LLMEngine.create(model, EngineConfig(num_blocks=blocks, block_size=BLOCK, max_num_seqs=len(prompts),
                                                  max_num_batched_tokens=1024, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return engine.generate(prompts, [params] * len(prompts))


def prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits [n, V] of every position of `ids`, one prefill in a fresh cache."""
    n = len(ids)
    num_blocks = -(-n // BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_prefills=1, num_prefill_tokens=n,
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
        prefill_block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        decode_block_tables=torch.zeros(0, num_blocks, dtype=torch.int32), logits_indices=torch.arange(n),
    )
    cache = KVCache.allocate(model.config, num_blocks, BLOCK, model.dtype, "cpu")
    return model(torch.tensor(ids), torch.arange(n), meta, cache)  # [n, V]


def perplexity(model: LlamaModel, ids: list[int]) -> float:
    """exp(mean next-token NLL) of `ids`, scored in one prefill."""
    logits = prefill_logits(model, ids)
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def chunked_perplexity(model: LlamaModel, ids: list[int], ctx: int) -> float:
    """llama-perplexity's figure for `-c ctx` (a tokenizer without BOS, as SmolLM2's): exp(mean NLL) over
    positions ctx/2 .. ctx-2 of every whole chunk of ctx tokens, each chunk a fresh prefill."""
    first, total, count = ctx // 2, 0.0, 0
    for start in range(0, len(ids) - ctx + 1, ctx):
        chunk = ids[start:start + ctx]
        logits = prefill_logits(model, chunk).double()  # [ctx, V]
        nll = F.cross_entropy(logits[first:-1], torch.tensor(chunk[first + 1:]), reduction="sum")
        total, count = total + nll.item(), count + ctx - 1 - first
    return math.exp(total / count)


def llama_perplexity(binary: str, model: Path, text: str, ctx: int, threads: int) -> tuple[float, int]:
    """llama.cpp's own figure for the same file, text and context: `llama-perplexity`'s final estimate
    and the number of chunks it scored (equal to ours when both tokenize the text alike)."""
    run = subprocess.run([binary, "-m", str(model), "-f", text, "-c", str(ctx), "-b", str(ctx), "-t", str(threads)],
                         capture_output=True, text=True, check=True)
    log = run.stdout + run.stderr
    estimate = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if not estimate or not chunks:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{log[-2000:]}")
    return float(estimate.group(1)), int(chunks.group(1))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=model_store.DEFAULT_MODEL)
    parser.add_argument("--formats", default=",".join(WEIGHT_FORMATS),
                        help="none is the fp32 reference; auto keeps a quantized GGUF's own formats")
    parser.add_argument("--ctx", type=int, default=0, help="score perplexity as llama-perplexity -c CTX does")
    parser.add_argument("--text", default=str(HERE / "data" / "perplexity.txt"), help="the perplexity text")
    parser.add_argument("--no-greedy", dest="greedy", action="store_false", help="perplexity only")
    parser.add_argument("--llama-perplexity", default="", help="path of llama.cpp's llama-perplexity: score the "
                        "same file, text and --ctx with it too, beside each format")
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity's -t")
    parser.add_argument("--output", default=str(HERE / "results" / "quality.json"))
    args = parser.parse_args(argv)
    if args.llama_perplexity and not args.ctx:
        parser.error("--llama-perplexity needs --ctx (llama-perplexity scores in chunks)")
    tok = load_tokenizer(model_store.resolve(args.model))
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    text_ids = tok.encode(Path(args.text).read_text())
    formats = [f for f in args.formats.split(",") if f != "none"]
    llama = None
    if args.llama_perplexity:
        llama_ppl, chunks = llama_perplexity(args.llama_perplexity, model_store.resolve(args.model), args.text, args.ctx,
                                             args.threads)
        llama = {"perplexity": llama_ppl, "chunks": chunks, "threads": args.threads,
                 "build_options": cmake_options(Path(args.llama_perplexity))}
        print("llama-perplexity", json.dumps(llama), flush=True)
    rows, reference = [], None
    for fmt in (["none"] if args.greedy else []) + formats:
        start = time.perf_counter()
        model = load_model(args.model, "cpu", torch.float32, quantization=fmt)
        row = {"format": fmt, "text_tokens": len(text_ids), "ctx": args.ctx or len(text_ids),
               "chunks": len(text_ids) // args.ctx if args.ctx else 1}
        if args.greedy:
            outs = greedy_outputs(model, prompts)
            reference = reference or outs
            prefix = [common_prefix(a, b) for a, b in zip(outs, reference)]
            row |= {"prompts": len(prompts), "identical_32_tokens": sum(p == NEW_TOKENS for p in prefix) / len(prompts),
                    "mean_common_prefix": sum(prefix) / len(prompts)}
        ppl = chunked_perplexity(model, text_ids, args.ctx) if args.ctx else perplexity(model, text_ids)
        row["perplexity"] = round(ppl, 4)
        if llama:
            row["vs_llama_perplexity"] = round(ppl / float(llama["perplexity"]) - 1, 5)
        rows.append(row)
        print(json.dumps(rows[-1]), f"({time.perf_counter() - start:.0f} s)", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_path = model_store.resolve(args.model)
    result = {"model": model_identity(model_path) if model_path.is_file() else args.model,
              "text": Path(args.text).name, "new_tokens": NEW_TOKENS, "machine": machine_info(),
              "llama_perplexity": llama, "results": rows}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
