"""Issue 7 kernel benchmark (GPU only): paged decode attention and one 8B decode step vs the roofline.

    python bench/kernels.py [--out DIR] [--quick]

1. Device copy bandwidth (device-to-device copy, bytes read + written per second), measured here.
2. Paged decode attention, Llama-3-8B head shapes (32 q heads, 8 kv heads, head dim 128, bf16,
   block 16, shuffled blocks) at batch 1/16/64/256 x context 512/2048/8192: achieved GB/s
   (K/V + q bytes read per second) as a fraction of the copy bandwidth, and the time of torch
   scaled_dot_product_attention on the same K/V gathered contiguous (gather not timed).
3. Engine decode step, Llama-3-8B shape with random weights, batch 64 at context 2048: time
   (eager and CUDA-graph replay) vs roofline = (weight bytes + KV bytes) / copy bandwidth.
4. Weight-only int8 decode GEMV (int8_gemv.cu) on Llama-3-8B's four GEMM shapes at 1/8/32 tokens:
   time and weight GB/s beside bf16 cuBLAS (x @ W.T) on the same shapes, the baseline a user has.

Writes kernels.json and decode_attention_gbps.png (if matplotlib is there) under --out
(default: $OUT, else bench/results). Imports only torch, numpy, cupy (via ops), matplotlib and
our model/ops modules, so it runs on a bare GPU image.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_worker.model.config import ModelConfig  # noqa: E402
from gpu_worker.model.kv_cache import KVCache  # noqa: E402
from gpu_worker.model.llama import LlamaModel  # noqa: E402
from gpu_worker.model.metadata import AttentionMetadata  # noqa: E402
from gpu_worker.ops.cuda import kernels  # noqa: E402
from gpu_worker.ops.cuda import ops as cuda  # noqa: E402
from gpu_worker.ops.weights.quantized_linear import int8_per_channel  # noqa: E402
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, context_length=8192)


def log(msg: str) -> None:
    print(msg, flush=True)


def time_graph(fn, calls: int = 20, replays: int = 5) -> float:
    """Seconds per call of fn, from CUDA-graph replays of `calls` back-to-back calls (no launch
    overhead in the figure); eager loop if capture fails."""
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            for _ in range(calls):
                fn()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - report and fall back
        log(f"  (graph capture failed: {exc!r}; timing eagerly)")

        def run():
            for _ in range(calls):
                fn()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = time_graph(lambda: dst.copy_(src), calls=5)
    return 2 * n * 2 / seconds


def paged_case(batch: int, context: int, seed: int = 0):
    """q, shuffled paged K/V caches, block tables and lengths for `batch` sequences of `context` tokens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    tables = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, lens


def gathered(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hk, D] -> [B, Hk, L, D] contiguous, in each sequence's order."""
    b, nb = tables.shape
    return cache[tables.long()].view(b, nb * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()


def bench_attention(batch: int, context: int, copy_bw: float) -> dict:
    q, kc, vc, tables, lens = paged_case(batch, context)
    scale = HEAD_DIM**-0.5
    ours = time_graph(lambda: cuda.paged_decode_attention(q, kc, vc, tables, lens, scale))
    k, v = gathered(kc, tables), gathered(vc, tables)
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    sdpa = time_graph(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
    out_ours = cuda.paged_decode_attention(q, kc, vc, tables, lens, scale).float()
    out_sdpa = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True).squeeze(2).float()
    max_err = float((out_ours - out_sdpa).abs().max())
    nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 + q.numel() * 2
    plan = kernels.plan_decode(HEADS // KV_HEADS, tables.shape[1], BLOCK)
    torch.cuda.empty_cache()
    gbps = nbytes / ours / 1e9
    return {"batch": batch, "context": context, "bytes": nbytes, "ours_us": ours * 1e6, "sdpa_us": sdpa * 1e6,
            "ours_gbps": gbps, "sdpa_gbps": nbytes / sdpa / 1e9, "fraction_of_copy": gbps * 1e9 / copy_bw,
            "speedup_vs_sdpa": sdpa / ours, "max_abs_diff_vs_sdpa": max_err,
            "num_partitions": plan.num_partitions}


def random_llama(config: ModelConfig) -> LlamaModel:
    model = LlamaModel(config, device="cuda", dtype=DTYPE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model


def decode_inputs(batch: int, context: int, max_blocks: int):
    """A pure-decode step: each sequence owns max_blocks consecutive blocks, context tokens cached."""
    i32 = dict(dtype=torch.int32, device="cuda")
    tables = torch.arange(batch * max_blocks, **i32).view(batch, max_blocks)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device="cuda")
    slots = tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK
    meta = AttentionMetadata(
        slot_mapping=slots, num_prefills=0, num_prefill_tokens=0, prefill_query_start_loc=torch.zeros(1, **i32),
        prefill_context_lens=torch.zeros(0, **i32), prefill_block_tables=torch.zeros(0, max_blocks, **i32),
        decode_context_lens=torch.full((batch,), context, **i32), decode_block_tables=tables,
        logits_indices=torch.arange(batch, device="cuda"))
    ids = torch.randint(0, 1000, (batch,), device="cuda")
    return ids, positions, meta


def weight_bytes_per_step(model: LlamaModel, batch: int) -> int:
    """Every weight is read once per step, except the embedding table (only `batch` rows)."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed")
    return total + batch * model.config.hidden_size * 2


def bench_engine_step(copy_bw: float, batch: int = 64, context: int = 2048) -> dict:
    config = LLAMA3_8B
    model = random_llama(config)
    max_blocks = context // BLOCK
    cache = KVCache.allocate(config, batch * max_blocks, BLOCK, DTYPE, "cuda")
    ids, positions, meta = decode_inputs(batch, context, max_blocks)
    model(ids, positions, meta, cache)  # warm-up: NVRTC compiles, cuBLAS picks kernels
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        model(ids, positions, meta, cache)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / 5
    runner = DecodeGraphRunner(model, cache, batch_sizes=(batch,), max_blocks=max_blocks)
    runner.capture()
    graph = time_graph(lambda: runner.run(ids, positions, meta), calls=1, replays=10)
    kv_bytes = 2 * config.num_layers * batch * context * config.num_kv_heads * config.head_dim * 2
    w_bytes = weight_bytes_per_step(model, batch)
    roofline = (w_bytes + kv_bytes) / copy_bw
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "weight_bytes": w_bytes, "kv_bytes": kv_bytes,
            "roofline_ms": roofline * 1e3, "eager_ms": eager * 1e3, "graph_ms": graph * 1e3,
            "graph_over_roofline": graph / roofline, "eager_over_roofline": eager / roofline}


def bench_int8_gemv(copy_bw: float) -> list[dict]:
    """int8_gemv.cu vs bf16 cuBLAS on the 8B layer's GEMMs (qkv, o, gate_up, down) at decode batch sizes."""
    c = LLAMA3_8B
    shapes = {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
        q, scale = int8_per_channel(w)
        for tokens in (1, 8, 32):
            x = torch.randn(tokens, k, device="cuda", dtype=DTYPE)
            ours = time_graph(lambda x=x, q=q, scale=scale: cuda.int8_linear(x, q, scale))
            cublas = time_graph(lambda x=x, w=w: x @ w.t())
            rows.append({"gemm": name, "n": n, "k": k, "tokens": tokens, "int8_us": ours * 1e6,
                         "bf16_cublas_us": cublas * 1e6, "int8_weight_gbps": n * k / ours / 1e9,
                         "bf16_weight_gbps": n * k * 2 / cublas / 1e9, "speedup": cublas / ours,
                         "int8_fraction_of_copy": n * k / ours / copy_bw})
        del w, q
    torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], copy_bw: float, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - optional
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({r["batch"] for r in rows}):
        sel = [r for r in rows if r["batch"] == batch]
        ctx = [r["context"] for r in sel]
        ax.plot(ctx, [r["ours_gbps"] for r in sel], "o-", label=f"paged kernel, batch {batch}")
        ax.plot(ctx, [r["sdpa_gbps"] for r in sel], "x--", alpha=0.6, label=f"SDPA gathered, batch {batch}")
    ax.axhline(copy_bw / 1e9, color="k", lw=1, label="device copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("GB/s (K/V + q bytes read)")
    ax.set_title("Paged decode attention, 32q/8kv heads, d=128, bf16")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes, no 8B engine step")
    args = parser.parse_args(argv)
    reason = cuda.unavailable_reason()
    if reason:
        log(f"no GPU benchmark: {reason}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"device: {torch.cuda.get_device_name(0)}, {cuda._num_sms(0)} SMs")
    copy_bw = copy_bandwidth()
    log(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")
    batches, contexts = ((1, 64), (512, 2048)) if args.quick else ((1, 16, 64, 256), (512, 2048, 8192))
    rows = []
    log(f"{'batch':>5} {'ctx':>5} {'parts':>5} {'ours us':>9} {'GB/s':>7} {'of copy':>7} {'SDPA us':>9} {'speedup':>7}")
    for batch in batches:
        for context in contexts:
            r = bench_attention(batch, context, copy_bw)
            rows.append(r)
            log(f"{batch:5d} {context:5d} {r['num_partitions']:5d} {r['ours_us']:9.1f} {r['ours_gbps']:7.0f} "
                f"{r['fraction_of_copy']:7.1%} {r['sdpa_us']:9.1f} {r['speedup_vs_sdpa']:6.2f}x")
    result = {"device": torch.cuda.get_device_name(0), "copy_gbps": copy_bw / 1e9, "decode_attention": rows}
    if not args.quick:
        step = bench_engine_step(copy_bw)
        result["engine_step"] = step
        log(f"8B decode step, batch {step['batch']}, ctx {step['context']}: graph {step['graph_ms']:.2f} ms, "
            f"eager {step['eager_ms']:.2f} ms, roofline {step['roofline_ms']:.2f} ms "
            f"({step['graph_over_roofline']:.2f}x roofline with graphs)")
    log(f"{'gemm':>8} {'N':>6} {'K':>6} {'tok':>4} {'int8 us':>8} {'GB/s':>6} {'bf16 cuBLAS us':>14} {'GB/s':>6} {'speedup':>7}")
    result["int8_gemv"] = bench_int8_gemv(copy_bw)
    for r in result["int8_gemv"]:
        log(f"{r['gemm']:>8} {r['n']:6d} {r['k']:6d} {r['tokens']:4d} {r['int8_us']:8.1f} {r['int8_weight_gbps']:6.0f} "
            f"{r['bf16_cublas_us']:14.1f} {r['bf16_weight_gbps']:6.0f} {r['speedup']:6.2f}x")
    (out / "kernels.json").write_text(json.dumps(result, indent=2))
    if plot(rows, copy_bw, out / "decode_attention_gbps.png"):
        log(f"plot: {out / 'decode_attention_gbps.png'}")
    log(f"results: {out / 'kernels.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
