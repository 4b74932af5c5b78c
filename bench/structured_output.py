"""Cost of grammar masks: engine tok/s of 16 streams with and without a JSON-schema constraint,
and with tools (the tool-calling grammar of gateway/tool_calls.py, tool_choice required).

    .venv/bin/python -m bench.structured_output [--streams 16] [--output-len 64] [--rounds 3] [--output PATH]

One engine on the real model (CPU), the same prompts and seeded sampling; each round runs the
free batch, then the constrained batch, so machine noise hits both alike. Every constrained
sequence runs to --output-len: the schema needs longer documents than that (an array of at
least 40 strings of 8+ characters; the tool's arguments alike), and free sequences ignore EOS,
so every side decodes the same number of tokens. Every side gets the same prompts: the rows
measure the grammar, not the longer prompt a tool list makes. Prints tok/s of each side (best
round and mean), the overheads, and the share of each constrained side's time spent computing
and applying masks (measured directly, so other load on the machine does not blur it as it
blurs the tok/s comparison). --output writes the same figures, the machine, the load average
before and after, and the command as JSON (bench/results/structured_output/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.openai_standard import machine_info
from gateway.tool_calls import grammar_of as tool_grammar_of
from gateway.tool_calls import tool_spec
from gpu_worker.engine.constraint import load_constraints
from gpu_worker.engine.engine import EngineConfig, LLMEngine
from gpu_worker.engine.sequence import SamplingParams, Sequence
from gpu_worker.model.loader import load_model
from llmserve.catalog import model_store
from llmserve.protocol.grammar import grammar_of
from llmserve.v1 import inference_pb2 as pb
from tokenizer_svc.loader import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 30},
    "items": {"type": "array", "minItems": 40, "items": {"type": "string", "minLength": 8, "maxLength": 24}}},
    "required": ["title", "items"], "additionalProperties": False}
TOOLS = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="-")], tools=[
    pb.Tool(name="save_list", parameters_json_schema=json.dumps(SCHEMA)),
    pb.Tool(name="save_notes", parameters_json_schema=json.dumps(SCHEMA))],
    tool_choice=pb.ToolChoice(required=True))
CONSTRAINED = ("json_schema", "tools")


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """(seconds, tokens generated) of one batch run to completion."""
    seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
    start = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start, sum(len(s.output_token_ids) for s in seqs)


def time_masks(constraints) -> list:
    """Wrap constraints.apply_masks to add up [seconds, calls] it spends (reset by the caller)."""
    totals = [0.0, 0]
    inner = constraints.apply_masks

    def timed(logits, seqs):
        start = time.perf_counter()
        out = inner(logits, seqs)
        totals[0] += time.perf_counter() - start
        totals[1] += 1
        return out

    constraints.apply_masks = timed
    return totals


@dataclass
class Bench:
    """One engine on the model, the prompts, and the sampling of every side."""

    engine: LLMEngine
    prompts: list[list[int]]
    sides: dict[str, list[SamplingParams]]
    masking: list                  # [seconds, calls] in the grammar masks (time_masks)


def setup(args: argparse.Namespace) -> Bench:
    path = model_store.resolve(args.model)
    tokenizer = load_tokenizer(path)
    model = load_model(str(path), "cpu")
    constraints = load_constraints(str(path), model.config.vocab_size)
    engine = LLMEngine.create(model, EngineConfig(num_blocks=64 * args.streams, block_size=16,
                                                  max_num_seqs=args.streams, max_num_batched_tokens=2048,
                                                  enable_prefix_caching=False),   # both sides prefill alike
                              constraints=constraints)
    grammars = {"free": "", "json_schema": grammar_of(pb.ResponseFormat(json_schema=json.dumps(SCHEMA))),
                "tools": tool_grammar_of(tool_spec(TOOLS))}
    prompts = [tokenizer.encode_chat([{"role": "user", "content": f"List {40 + i} fruits as JSON."}])
               for i in range(args.streams)]
    eos = tuple(tokenizer.eos_token_ids)
    sides = {side: [SamplingParams(temperature=0.8, seed=i, max_new_tokens=args.output_len, stop_token_ids=eos,
                                   grammar=grammar, ignore_eos=not grammar) for i in range(args.streams)]
             for side, grammar in grammars.items()}
    for side in CONSTRAINED:                                        # warm-up: vocabulary, grammars, kernels
        run(engine, prompts[:2], [sides[side][0]] * 2)
    return Bench(engine, prompts, sides, time_masks(constraints))


def measure(bench: Bench, args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """tok/s of every side each round, and each constrained side's share of time in masks."""
    rates: dict[str, list[float]] = {side: [] for side in bench.sides}
    mask_shares: dict[str, list[float]] = {side: [] for side in CONSTRAINED}
    for _ in range(args.rounds):
        for side, params in bench.sides.items():
            bench.masking[:] = [0.0, 0]
            steps = bench.engine.counters.steps
            seconds, tokens = run(bench.engine, bench.prompts, params)
            assert tokens == args.streams * args.output_len, (side, tokens)
            rates[side].append(tokens / seconds)
            if side in CONSTRAINED:
                mask_shares[side].append(bench.masking[0] / seconds)
            ms_per_step = 1000 * bench.masking[0] / max(1, bench.masking[1])
            share = f", masks {ms_per_step:.2f} ms/step = {100 * bench.masking[0] / seconds:.1f} %"
            print(f"  round: {side:<12} {tokens / seconds:7.1f} tok/s over {bench.engine.counters.steps - steps} steps"
                  + (share if bench.masking[1] else ""))
    return rates, mask_shares


def figures(rates: dict[str, list[float]], mask_shares: dict[str, list[float]]) -> dict:
    """The result: per side best and mean tok/s, and for constrained sides the overhead and mask share."""
    out: dict = {}
    for side, values in rates.items():
        out[side] = {"best_tok_s": max(values), "mean_tok_s": statistics.mean(values), "rounds_tok_s": values}
        if side in CONSTRAINED:
            out[side] |= {"overhead_best_vs_best": 1 - max(values) / max(rates["free"]),
                          "mask_time_share_mean": statistics.mean(mask_shares[side]),
                          "mask_time_share_rounds": mask_shares[side]}
    return out


def report(rows: dict, args: argparse.Namespace) -> None:
    print(f"{args.streams} streams x {args.output_len} tokens, {args.rounds} rounds, "
          f"{torch.get_num_threads()} torch threads (tok/s includes prefill)")
    for side, row in rows.items():
        print(f"  {side:<12} best {row['best_tok_s']:7.1f} tok/s   mean {row['mean_tok_s']:7.1f} tok/s")
    for side in CONSTRAINED:
        print(f"  {side}: tok/s overhead (best vs best) {100 * rows[side]['overhead_best_vs_best']:.1f} %; "
              f"time in masks {100 * rows[side]['mask_time_share_mean']:.1f} % (on a shared machine trust this one)")


def write(path: Path, rows: dict, args: argparse.Namespace, loadavg_before: tuple[float, ...]) -> None:
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(),
              "torch_threads": torch.get_num_threads(), "loadavg_before": loadavg_before,
              "loadavg_after": os.getloadavg(), "command": "python -m bench.structured_output " + " ".join(sys.argv[1:]),
              "args": {k: v for k, v in vars(args).items() if k != "output"}, "sides": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=model_store.DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--output", type=Path, default=None, help="also write the figures here as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loadavg_before = os.getloadavg()
    rows = figures(*measure(setup(args), args))
    report(rows, args)
    if args.output:
        write(args.output, rows, args, loadavg_before)


if __name__ == "__main__":
    main()
