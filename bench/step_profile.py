"""Where a decode step's time goes, per CPU weight format: wall time of an engine step at N
running sequences and the torch profiler's table of the ops inside it (the C kernels show as
`cpu_step_layers` (int4: every layer of a step in one call), `cpu_q4_1_linear`,
`cpu_q8_0_linear` (the int4 vocab head), `cpu_paged_decode_attention`).

    .venv/bin/python -m bench.step_profile                         # formats none,int4; 1 and 16 sequences
    .venv/bin/python -m bench.step_profile --formats int4 --sequences 1 --threads 1 --rows 25
    .venv/bin/python -m bench.step_profile --formats int4 --sequences 1 --prompt-tokens 32,1024,4096,8000

Each sequence has a prompt of --prompt-tokens (32); the steps timed are decodes after the prefill and
5 warm-up steps. With several prompt lengths, each line also gives the attention's share of a step at
that context: (step - the shortest context's step) / step, the part of the step that grew with the
context (the C step runs attention inside its one call, so no profiler row shows it alone).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.loader import load_model


def profile_format(fmt: str, sequences: int, steps: int, rows: int, model: str, prompt_tokens: int,
                   shortest_ms: float | None) -> float:
    """Time and profile `steps` decode steps; returns the wall ms of one."""
    llm = load_model(model, "cpu", torch.float32, quantization=fmt)
    new_tokens = 2 * steps + 10
    blocks = sequences * -(-(prompt_tokens + new_tokens) // 16)
    engine = LLMEngine.create(llm, EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=sequences,
                                                max_num_batched_tokens=512, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    seqs = [Sequence([100 + (i + t) % 20000 for t in range(prompt_tokens)], params) for i in range(sequences)]
    for seq in seqs:
        engine.add(seq)
    while not all(seq.output_token_ids for seq in seqs):   # the prefills
        engine.step()
    for _ in range(5):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    share = "" if shortest_ms is None else f"; attention's share at this context ~{1 - shortest_ms / wall_ms:.0%}"
    print(f"\n== {fmt}: {sequences} sequences of {prompt_tokens}-token prompts, {torch.get_num_threads()} threads: "
          f"{wall_ms:.1f} ms a decode step ({sequences * 1e3 / wall_ms:.1f} tok/s){share}; profiler totals "
          f"below are over {steps} steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    return wall_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--formats", default="none,int4")
    parser.add_argument("--sequences", default="1,16")
    parser.add_argument("--prompt-tokens", default="32", help="comma list of prompt lengths (contexts)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=12, help="ops shown per table")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = sorted(int(v) for v in args.prompt_tokens.split(","))
    for n in (int(v) for v in args.sequences.split(",")):
        for fmt in args.formats.split(","):
            shortest = None
            for length in lengths:
                wall_ms = profile_format(fmt, n, args.steps, args.rows, args.model, length, shortest)
                shortest = wall_ms if shortest is None else shortest


if __name__ == "__main__":
    main()
