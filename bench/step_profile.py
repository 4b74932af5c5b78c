"""Where a decode step's time goes, per CPU weight format: wall time of an engine step at N
running sequences and the torch profiler's table of the ops inside it (the C kernels show as
`cpu_step_layers` (int4: every layer of a step in one call), `cpu_q4_1_linear`,
`cpu_q8_0_linear` (the int4 vocab head), `cpu_paged_decode_attention`).

    .venv/bin/python -m bench.step_profile                         # formats none,int4; 1 and 16 sequences
    .venv/bin/python -m bench.step_profile --formats int4 --sequences 1 --threads 1 --rows 25

Each sequence has a 32-token prompt; the steps timed are decodes after 10 warm-up steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.loader import load_model


def profile_format(fmt: str, sequences: int, steps: int, rows: int, model: str) -> None:
    llm = load_model(model, "cpu", torch.float32, quantization=fmt)
    engine = LLMEngine.create(llm, EngineConfig(num_blocks=64 * sequences, block_size=16, max_num_seqs=sequences,
                                                max_num_batched_tokens=512, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_new_tokens=3 * steps + 20, ignore_eos=True)
    for i in range(sequences):
        engine.add(Sequence(list(range(100 + i, 132 + i)), params))
    for _ in range(10):  # the prefills, then decodes
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    print(f"\n== {fmt}: {sequences} sequences, {torch.get_num_threads()} threads: {wall_ms:.1f} ms a decode step "
          f"({sequences * 1e3 / wall_ms:.1f} tok/s); profiler totals below are over {steps} steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--formats", default="none,int4")
    parser.add_argument("--sequences", default="1,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=12, help="ops shown per table")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for n in (int(v) for v in args.sequences.split(",")):
        for fmt in args.formats.split(","):
            profile_format(fmt, n, args.steps, args.rows, args.model)


if __name__ == "__main__":
    main()
