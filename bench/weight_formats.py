"""CPU GEMV/GEMM time of every GGUF weight type on its C kernel, beside the Q4_1 kernel in the same run.

    PYTHONPATH=$PWD .venv/bin/python -m bench.weight_formats [--rows 1,4,16,64] [--threads 1] [--repeats 7]

One random weight per type of SmolLM2's MLP gate/up shape (N = 3072, K = 576 for the legacy types)
and its down shape with K a multiple of 256 (N = 576, K = 1536, every type), random blocks with
finite scales; per type and row count the median of `--repeats` timings of a call (each of enough
calls to take ~0.2 s), its weight bytes and GB/s of weight read. Also prepacked fp32 (oneDNN) on the
same shapes. Writes bench/results/weight_formats/threads<N>.json.

With `--threads 1` (the default) a call is timed in this thread's CPU time, which other processes
on a shared machine do not inflate (the kernels run in the calling thread); with more threads, in
wall time. The JSON says which (`clock`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from gpu_worker.ops.weights import gguf_blocks, gguf_weight
from gpu_worker.ops.weights.gguf_weight import FileTensor
from gpu_worker.ops.weights.packed_linear import linear
from gpu_worker.ops.weights.quantized_linear import QuantizedWeight
from tests.unit.gguf_random import random_blocks

HERE = Path(__file__).resolve().parent
T = GGMLQuantizationType
SHAPES = [(3072, 576), (576, 1536)]


def weight_for(ggml_type: GGMLQuantizationType, n: int, k: int):
    rng = np.random.default_rng(0)
    if ggml_type == T.F32:
        return gguf_weight.cpu_weight([FileTensor(T.F32, rng.standard_normal((n, k)).astype(np.float32) * 0.05, k)])
    return gguf_weight.cpu_weight([FileTensor(ggml_type, random_blocks(ggml_type, n, k, rng, scale=1e-3), k)])


def weight_bytes(weight: QuantizedWeight | torch.Tensor) -> int:
    return weight.nbytes if isinstance(weight, QuantizedWeight) else weight.numel() * weight.element_size()


def seconds_per_call(weight, x: torch.Tensor, repeats: int, clock=time.perf_counter) -> float:
    linear(x, weight)
    start, calls = clock(), 0
    while clock() - start < 0.2:
        linear(x, weight)
        calls += 1
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            linear(x, weight)
        times.append((clock() - start) / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "weight_formats"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    clock, clock_name = (time.thread_time, "thread cpu") if args.threads == 1 else (time.perf_counter, "wall")
    results = []
    for n, k in SHAPES:
        types = [T.F32, *(t for t in gguf_blocks.QUANTIZED_TYPES if k % 256 == 0 or t in gguf_blocks.LEGACY_TYPES)]
        for ggml_type in types:
            weight = weight_for(ggml_type, n, k)
            nbytes = weight_bytes(weight)
            for m in rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                s = seconds_per_call(weight, x, args.repeats, clock)
                results.append({"type": ggml_type.name, "n": n, "k": k, "rows": m, "us": round(s * 1e6, 1),
                                "weight_bytes": nbytes, "bits_per_weight": round(8 * nbytes / (n * k), 3),
                                "weight_gb_s": round(nbytes / s / 1e9, 2)})
                print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"threads": args.threads, "clock": clock_name, "results": results}
    path = out / f"threads{args.threads}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
