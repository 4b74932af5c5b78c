"""CPU GEMV/GEMM time of every GGUF weight type on its C kernel, beside the Q4_1 kernel in the same run.

    PYTHONPATH=$PWD .venv/bin/python -m bench.weight_formats [--rows 1,4,16,64] [--threads 1] [--repeats 7]

One random weight per type of SmolLM2's MLP gate/up shape (N = 3072, K = 576 for the legacy types)
and its down shape with K a multiple of 256 (N = 576, K = 1536, every type), random blocks with
finite scales; per type and row count the median of `--repeats` timings of a call (each of enough
calls to take ~0.2 s), its weight bytes and GB/s of weight read. Also prepacked fp32 (oneDNN) on the
same shapes. Writes bench/results/weight_formats/threads<N>.json.

    PYTHONPATH=$PWD .venv/bin/python -m bench.weight_formats --model FILE.gguf --llama-server PATH [--rounds 5]

With --llama-server: llmserve's engine (built as the worker builds it, `--quantization auto`, 2
threads, its defaults: greedy decoding at 1 stream drafts by prompt lookup) against llama.cpp's
`llama-server` (-t 2, one slot per stream, `--llama-args`: -tb 2 --poll 0) on the same GGUF, in
alternating rounds (odd rounds llmserve first, even rounds llama-server first), the same random
token ids to both: decode tok/s at 1 and 16 streams (per stream: tokens after its first over the
time from its first token to its last, summed over the streams; llama-server's own `timings`) and
prefill tok/s of one --prefill-tokens prompt (its step time; llama-server's `prompt_per_second`).
Neither side counts HTTP or tokenization. Medians over the rounds, the 1-minute load average around
each round. Writes bench/results/weight_formats/vs_llama_server-<file>.json.

With `--threads 1` (the default) a call is timed in this thread's CPU time, which other processes
on a shared machine do not inflate (the kernels run in the calling thread); with more threads, in
wall time. The JSON says which (`clock`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
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
    parser.add_argument("--model", default="", help="a GGUF file (with --llama-server)")
    parser.add_argument("--llama-server", default="", help="llama-server binary: engine vs llama-server on --model")
    parser.add_argument("--llama-args", default="-tb 2 --poll 0", help="llama-server flags beside -t 2 and the slots")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    if args.llama_server:
        engine_vs_llama_server(args)
        return
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


# ---- llmserve's engine against llama-server on one GGUF ----------------------------------------------------

def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Token ids well inside SmolLM2's vocabulary, distinct per round (no prefix-cache hit either side)."""
    gen = torch.Generator().manual_seed(seed % 2**31)
    return torch.randint(100, 40000, (count, length), generator=gen).tolist()


class EngineSide:
    """llmserve's engine as `python -m gpu_worker` builds it, on the CPU with 2 torch threads."""

    name = "llmserve"

    def __init__(self, model: str) -> None:
        from gpu_worker.config import WorkerSettings
        from gpu_worker.service import build_engine, warm_up

        self.engine = build_engine(WorkerSettings(model=model, device="cpu", torch_threads=2, bandwidth_probe=False))
        warm_up(self.engine)
        assert self.engine.constraints is not None
        _ = self.engine.constraints.tokenizer  # the worker loads it in the background: not during a round

    def decode(self, prompts: list[list[int]], tokens: int) -> float:
        """Summed per-stream decode tok/s: tokens after each stream's first over its first-to-last time."""
        from gpu_worker.engine.sequence import SamplingParams, Sequence

        params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
        seqs = [Sequence(list(p), params) for p in prompts]
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for seq in seqs:
            self.engine.add(seq)
        while self.engine.has_work():
            for out in self.engine.step():   # the sequences that got a token this step
                now = time.perf_counter()
                first.setdefault(out.seq.seq_id, now)
                last[out.seq.seq_id] = now
        self.engine.reset_stats()
        return sum((len(s.output_token_ids) - 1) / (last[s.seq_id] - first[s.seq_id]) for s in seqs)

    def prefill(self, prompt: list[int]) -> float:
        """Prompt tokens per second of the steps that computed it (one step up to the token budget)."""
        from gpu_worker.engine.sequence import SamplingParams, Sequence

        seq = Sequence(list(prompt), SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
        self.engine.add(seq)
        start = time.perf_counter()
        while self.engine.has_work():
            self.engine.step()
        seconds = time.perf_counter() - start
        self.engine.reset_stats()
        return len(prompt) / seconds

    def close(self) -> None:
        pass


class LlamaServerSide:
    """llama.cpp's server on the same file: 2 threads, one slot per stream, prompt cache off."""

    name = "llama-server"

    def __init__(self, binary: str, model: str, slots: int, slot_tokens: int, flags: str, log: Path) -> None:
        from bench.openai_standard import LlamaServer

        self.server = LlamaServer(binary, Path(model), slots, slot_tokens,
                                  argparse.Namespace(llama_threads=2, llama_args=flags), log)
        self.url = self.server.url
        self.server.wait_ready()
        self._complete([1, 2, 3, 4, 5, 6, 7, 8], 2)  # warm-up, as the engine's

    def _complete(self, prompt: list[int], tokens: int) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False,
                           "temperature": 0.0, "top_k": 1}).encode()
        request = urllib.request.Request(f"{self.url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.loads(reply.read())["timings"]

    def decode(self, prompts: list[list[int]], tokens: int) -> float:
        """Summed per-stream decode tok/s, each from its own `timings.predicted_per_second`."""
        timings: list[dict] = [{} for _ in prompts]

        def one(i: int) -> None:
            timings[i] = self._complete(prompts[i], tokens)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(t["predicted_per_second"] for t in timings)

    def prefill(self, prompt: list[int]) -> float:
        return float(self._complete(prompt, 1)["prompt_per_second"])

    def close(self) -> None:
        self.server.close()


def measure_round(side, streams: list[int], args: argparse.Namespace, seed: int) -> dict[str, float]:
    figures = {f"decode_tok_s_{n}": side.decode(random_prompts(n, 16, seed + n), args.decode_tokens)
               for n in streams}
    figures["prefill_tok_s"] = side.prefill(random_prompts(1, args.prefill_tokens, seed)[0])
    return figures


def engine_vs_llama_server(args: argparse.Namespace) -> None:
    from bench.openai_standard import cmake_options, machine_info, model_identity

    streams = [int(s) for s in args.streams.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sides = [EngineSide(args.model), LlamaServerSide(args.llama_server, args.model, max(streams),
                                                     args.prefill_tokens + 16, args.llama_args,
                                                     Path(tempfile.gettempdir()) / "llama_server.log")]
    rounds = []
    try:
        for side in sides:
            measure_round(side, streams, args, seed=-1)  # warm-up round of every shape, not recorded
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            load_before = os.getloadavg()[0]
            figures = {side.name: measure_round(side, streams, args, seed=1000 * r) for side in order}
            rounds.append({"order": [s.name for s in order], "load_1m": [load_before, os.getloadavg()[0]], **figures})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        for side in sides:
            side.close()
    keys = [k for k in rounds[0]["llmserve"]]
    median = {name: {k: round(statistics.median(r[name][k] for r in rounds), 1) for k in keys}
              for name in ("llmserve", "llama-server")}
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, check=False)
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine_info(),
        "model": model_identity(Path(args.model)),
        "llama_server": {"command": sides[1].server.command, "version": (version.stdout + version.stderr).strip(),
                         "build_options": cmake_options(Path(args.llama_server))},
        "workload": {"streams": streams, "prompt_tokens": 16, "decode_tokens": args.decode_tokens,
                     "prefill_tokens": args.prefill_tokens, "rounds": args.rounds, "greedy": True},
        "median": median, "ratio_llmserve_over_llama": {k: round(median["llmserve"][k] / median["llama-server"][k], 2)
                                                       for k in keys},
        "load_1m_range": [min(min(r["load_1m"]) for r in rounds), max(max(r["load_1m"]) for r in rounds)],
        "rounds": rounds,
    }
    path = out / f"vs_llama_server-{Path(args.model).stem}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("median", "ratio_llmserve_over_llama", "load_1m_range")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
