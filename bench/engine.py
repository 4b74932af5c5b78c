"""Offline engine benchmark on CPU: throughput (tokens/s) and inter-token latency of the
continuous-batching paged-KV engine at 1, 4, 16, 32 concurrent sequences, for every CPU weight
format (`--formats none,int8,int4`: fp32 prepacked, weight-only int8, int4), side by side with
baselines on the same model in the same run:

- naive: Hugging-Face-style `generate`, one request at a time (plain torch `F.linear` on the
  weights as loaded, dense KV cache grown by concatenation, no batching);
- static: Hugging-Face-style static batching: the N requests padded into one batch and run by
  one `generate` to the end (same dense code, batched);
- llama.cpp: `llama-cpp-python` (the opt-in `bench` extra) on the same GGUF, 1 stream, with
  torch's thread count; skipped when the package is not installed.

    .venv/bin/python -m bench.engine                       # prompt 128, output 128
    .venv/bin/python -m bench.engine --output-len 32 --concurrency 1,4,16 --formats none,int4

Writes bench/results/engine.json and bench/results/engine_tokens_per_s.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gpu_worker.config import WEIGHT_FORMATS
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.loader import load_model
from gpu_worker.ops import reference as ops
from llmserve.catalog import model_store

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Result:
    system: str
    concurrency: int
    requests: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    itl_ms_p50: float
    itl_ms_p90: float


# --- dense baselines -------------------------------------------------------------------------
class DenseGenerator:
    """Hugging-Face-style generate over a left-padded batch; K/V kept as dense [B, Hk, C, D]
    tensors grown with torch.cat. A batch of one is the naive one-at-a-time server."""

    def __init__(self, model: LlamaModel) -> None:
        self.m = model
        self.c = model.config

    def _attention(self, q, k, v, key_ok: torch.Tensor) -> torch.Tensor:
        """q: [B, L, Hq, D], k/v: [B, C, Hk, D] (whole context), key_ok: [B, C] -> [B, L, Hq * D]."""
        c = self.c
        group = c.num_heads // c.num_kv_heads
        kk = k.transpose(1, 2).repeat_interleave(group, 1)                        # [B, Hq, C, D]
        vv = v.transpose(1, 2).repeat_interleave(group, 1)
        length, context = q.shape[1], k.shape[1]
        causal = torch.ones(length, context, dtype=torch.bool).tril(context - length)  # [L, C]
        # a padding query also sees itself, so its row stays finite (it is never read)
        self_key = torch.zeros(length, context, dtype=torch.bool).diagonal_scatter(
            torch.ones(length, dtype=torch.bool), context - length)
        mask = (causal & key_ok[:, None, :]) | self_key                           # [B, L, C]
        att = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask[:, None])  # [B, Hq, L, D]
        return att.transpose(1, 2).reshape(q.shape[0], length, c.q_size)

    def _layer(self, layer, x: torch.Tensor, pos: torch.Tensor, key_ok: torch.Tensor, cache: list,
               i: int) -> torch.Tensor:
        """x: [B, L, H], pos: [B, L] -> [B, L, H]."""
        c = self.c
        b, length = x.shape[:2]
        h = ops.rms_norm(x, layer.input_norm, c.rms_norm_eps)
        q, k, v = F.linear(h, layer.qkv_weight, layer.qkv_bias).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q, k = ops.rotary_embedding(pos.flatten(), q.reshape(-1, c.num_heads, c.head_dim),
                                    k.reshape(-1, c.num_kv_heads, c.head_dim), self.m.cos_sin, c.rope_interleaved)
        q = q.view(b, length, c.num_heads, c.head_dim)
        k = k.view(b, length, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, length, c.num_kv_heads, c.head_dim)
        if cache[i] is not None:
            k = torch.cat([cache[i][0], k], dim=1)                                # [B, C, Hk, D]
            v = torch.cat([cache[i][1], v], dim=1)
        cache[i] = (k, v)
        x = x + F.linear(self._attention(q, k, v, key_ok), layer.o_weight)
        h = ops.rms_norm(x, layer.post_norm, c.rms_norm_eps)
        return x + F.linear(ops.silu_and_mul(F.linear(h, layer.gate_up_weight).flatten(0, 1)),
                            layer.down_weight).view(b, length, -1)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, key_ok: torch.Tensor, cache: list) -> torch.Tensor:
        """ids, pos: [B, L] -> next-token logits [B, V] (of each row's last position)."""
        x = F.embedding(ids, self.m.embed)                                         # [B, L, H]
        for i, layer in enumerate(self.m.layers):
            x = self._layer(layer, x, pos, key_ok, cache, i)
        x = ops.rms_norm(x[:, -1], self.m.norm, self.c.rms_norm_eps)
        return F.linear(x.to(self.m.lm_head.dtype), self.m.lm_head).float()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy tokens of each prompt and the time each step's tokens came out."""
        width = max(map(len, prompts))
        pad = torch.tensor([width - len(p) for p in prompts])                     # left padding per row
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])   # [B, W]
        key_ok = torch.arange(width)[None, :] >= pad[:, None]                      # [B, W]
        cache: list = [None] * self.c.num_layers
        logits = self._forward(ids, (torch.arange(width)[None, :] - pad[:, None]).clamp(min=0), key_ok, cache)
        out: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        for step in range(max_new):
            nxt = logits.argmax(dim=-1)                                            # [B]
            now = time.perf_counter()
            for row, token in enumerate(nxt.tolist()):
                out[row].append(token)
                times[row].append(now)
            if step + 1 == max_new:
                break
            key_ok = torch.cat([key_ok, torch.ones(len(prompts), 1, dtype=torch.bool)], dim=1)
            logits = self._forward(nxt[:, None], (width + step - pad)[:, None], key_ok, cache)
        return out, times


# --- runs ------------------------------------------------------------------------------------
def itl_stats(per_seq_times: list[list[float]]) -> tuple[float, float]:
    gaps = sorted(1000 * (b - a) for ts in per_seq_times for a, b in zip(ts, ts[1:]))
    if not gaps:
        return 0.0, 0.0
    return statistics.median(gaps), gaps[int(0.9 * (len(gaps) - 1))]


def run_engine(model: LlamaModel, fmt: str, prompts: list[list[int]], output_len: int, args) -> tuple[Result, list]:
    n = len(prompts)
    blocks = n * (-(-(len(prompts[0]) + output_len) // args.block_size)) + 8
    engine = LLMEngine.create(model, EngineConfig(num_blocks=blocks, block_size=args.block_size, max_num_seqs=n,
                                                  max_num_batched_tokens=args.max_batched_tokens,
                                                  enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    seqs = [Sequence(list(p), params) for p in prompts]
    times: dict[int, list[float]] = {s.seq_id: [] for s in seqs}
    start = time.perf_counter()
    for s in seqs:
        engine.add(s)
    with tqdm(total=n * output_len, desc=f"engine  x{n:<3}", unit="tok", leave=False) as bar:
        while engine.has_work():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.new_token_ids:
                    times[o.seq.seq_id].append(now)
            bar.update(sum(len(o.new_token_ids) for o in outs))
    seconds = time.perf_counter() - start
    tokens = sum(len(s.output_token_ids) for s in seqs)
    p50, p90 = itl_stats(list(times.values()))
    system = f"engine {'fp32' if fmt == 'none' else fmt}"
    return Result(system, n, n, tokens, seconds, tokens / seconds, p50, p90), [s.output_token_ids for s in seqs]


def run_dense(model: LlamaModel, prompts: list[list[int]], output_len: int, concurrency: int,
              batched: bool) -> tuple[Result, list]:
    """naive: requests one after another (measured on `len(prompts)` of the `concurrency`);
    static: all `concurrency` prompts padded into one batch and one generate."""
    gen = DenseGenerator(model)
    batches = [prompts] if batched else [[p] for p in prompts]
    outs, times = [], []
    start = time.perf_counter()
    for batch in tqdm(batches, desc=f"{'static' if batched else 'naive'}  x{concurrency:<3}", leave=False):
        tokens, ts = gen.generate(batch, output_len)
        outs += tokens
        times += ts
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    p50, p90 = itl_stats(times)
    system = "static" if batched else "naive"
    return Result(system, concurrency, len(prompts), tokens, seconds, tokens / seconds, p50, p90), outs


def run_llama_cpp(path: Path, prompt: list[int], output_len: int) -> tuple[Result, list] | None:
    """llama.cpp on the same GGUF, one stream, greedy; None where llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=len(prompt) + output_len + 8, n_threads=torch.get_num_threads(),
                n_batch=512, verbose=False)
    out, times = [], []
    start = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        times.append(time.perf_counter())
        if len(out) == output_len:
            break
    seconds = time.perf_counter() - start
    p50, p90 = itl_stats([times])
    return Result("llama.cpp", 1, 1, len(out), seconds, len(out) / seconds, p50, p90), [out]


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(r.system for r in results):
        rs = [r for r in results if r.system == system]
        style = "o-" if system.startswith("engine") else ("D" if len(rs) == 1 else "s--")
        ax.plot([r.concurrency for r in rs], [r.tokens_per_s for r in rs], style, label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def best_of(runs: list[Result]) -> Result:
    """On a shared, noisy machine the best run is the closest estimate of what the code itself costs."""
    return max(runs, key=lambda r: r.tokens_per_s)


def run_level(models: dict[str, LlamaModel], plain: LlamaModel, prompts: list[list[int]], args) -> list[Result]:
    """Every system at one concurrency, alternated `args.repeats` times; the best run of each.
    Also prints whether greedy outputs agree with the naive baseline."""
    n = len(prompts)
    runs: dict[str, list[Result]] = {}
    agree: dict[str, int] = {}
    for _ in range(args.repeats):
        base, base_out = run_dense(plain, prompts[:min(n, args.baseline_requests)], args.output_len, n, False)
        runs.setdefault(base.system, []).append(base)
        systems = [lambda m=m, fmt=fmt: run_engine(m, fmt, prompts, args.output_len, args)
                   for fmt, m in models.items()]
        systems.append(lambda: run_dense(plain, prompts, args.output_len, n, True))
        for run in systems:
            result, outs = run()
            runs.setdefault(result.system, []).append(result)
            agree[result.system] = sum(a == b for a, b in zip(outs, base_out))
    best = [best_of(r) for r in runs.values()]
    print(f"x{n:<3} " + "   ".join(f"{r.system} {r.tokens_per_s:7.1f} tok/s (itl p50 {r.itl_ms_p50:5.1f} ms)"
                                    for r in best), flush=True)
    print(f"     runs {({k: [round(r.tokens_per_s, 1) for r in v] for k, v in runs.items()})}; greedy outputs "
          f"equal to naive's (on {min(n, args.baseline_requests)}): {agree}", flush=True)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--formats", default=",".join(WEIGHT_FORMATS), help="engine weight formats (--quantization)")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--baseline-requests", type=int, default=1,
                        help="requests the naive baseline runs per level (it serves one at a time, so its "
                             "tokens/s does not depend on concurrency)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per level; the best is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
    models = {fmt: load_model(args.model, "cpu", dtypes[args.dtype], quantization=fmt)
              for fmt in args.formats.split(",")}
    plain_model = load_model(args.model, "cpu", dtypes[args.dtype], prepack=False)  # the dense baselines'
    gen = torch.Generator().manual_seed(0)
    levels = [int(x) for x in args.concurrency.split(",")]
    prompts = torch.randint(0, plain_model.config.vocab_size, (max(levels), args.prompt_len), generator=gen).tolist()
    results: list[Result] = []
    for n in levels:
        results += run_level(models, plain_model, prompts[:n], args)
    llama = run_llama_cpp(model_store.resolve(args.model), prompts[0], args.output_len)
    if llama is not None:
        results.append(best_of([llama[0]] + [run_llama_cpp(model_store.resolve(args.model), prompts[0],
                                                           args.output_len)[0] for _ in range(args.repeats - 1)]))
        print(f"llama.cpp x1 {results[-1].tokens_per_s:.1f} tok/s (itl p50 {results[-1].itl_ms_p50:.1f} ms)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = str(plain_model.dtype).removeprefix("torch.")
    meta = {"model": args.model, "dtype": dtype, "formats": args.formats, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "threads": torch.get_num_threads(), "repeats": args.repeats}
    (out / "engine.json").write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    plot(results, out / "engine_tokens_per_s.png",
         f"{args.model} CPU, prompt {args.prompt_len}, output {args.output_len}, {meta['threads']} threads")
    print(json.dumps(meta))
    print(f"wrote {out / 'engine.json'} and {out / 'engine_tokens_per_s.png'}")


if __name__ == "__main__":
    main()
