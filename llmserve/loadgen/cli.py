"""`llmserve bench` / `bench/load.py`: run load levels against a gateway and report.

    llmserve bench --target 127.0.0.1:50051 --concurrency 1,8,32 --requests 64 \\
        --prompt-tokens uniform:16:128 --output-tokens 32 --api-key dev-key --api-key other-key \\
        --output bench/results/cpu.json            # also writes bench/results/cpu.png
    llmserve bench --rate 0.5,1,2 --requests 60   # open loop, Poisson arrivals
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import sys
from pathlib import Path

from tqdm import tqdm

from llmserve.loadgen import report, roofline
from llmserve.loadgen.goodput import summarize_goodput
from llmserve.loadgen.runner import RunSettings, run_closed, run_open
from llmserve.loadgen.stats import RequestResult, summarize
from llmserve.loadgen.workload import DistError, WorkloadConfig, build_workload, parse_dist, poisson_arrivals
from llmserve.local.stack import STATE_DIR
from llmserve.protocol.slo import Targets


class UsageError(ValueError):
    """Bad command-line input."""


def _levels(text: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{text!r} is not a comma list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{text!r}: every level must be > 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve bench", description="Load generator for the llmserve gateway.")
    p.add_argument("--target", default=os.environ.get("LLMSERVE_TARGET", "127.0.0.1:50051"), help="gateway HOST:PORT")
    p.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                   help="tenant API key; repeat for several tenants (default: env LLMSERVE_API_KEY or dev-key)")
    p.add_argument("--tenant-weights", default="", help="comma list, one share per --api-key (default equal)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", default="", help="closed loop: comma list of client counts, e.g. 1,8,32")
    mode.add_argument("--rate", default="", help="open loop: comma list of Poisson rates in requests/s")
    p.add_argument("--requests", type=int, default=32, help="measured requests per load level")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent before each level")
    p.add_argument("--prompt-tokens", default="uniform:16:64", help="N | uniform:LO:HI | normal:MEAN:STD | exp:MEAN")
    p.add_argument("--output-tokens", default="32", help="max_new_tokens distribution (same forms)")
    p.add_argument("--model", default="", help="model id (default: the gateway's default model)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="send prompts as a user chat message")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths, tenants and arrivals")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline in seconds")
    p.add_argument("--output", default="", help="write the JSON report here")
    p.add_argument("--plot", default="", help="write the PNG plot here (default: next to --output when sweeping)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--slo-ttft-ms", type=int, default=0, help="TTFT target sent with every request; goodput "
                                                               "counts requests within it (0 = none)")
    p.add_argument("--slo-tpot-ms", type=int, default=0, help="time-per-output-token target (0 = none)")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--root-cert", default="", help="PEM root certificate for --tls")
    p.add_argument("--worker-metrics", default="auto",
                   help="workers' Prometheus endpoints for the roofline columns (achieved GB/s, fraction of the "
                        "probe): comma list of HOST:PORT or URLs, 'auto' (those `llmserve up` started from this "
                        "directory) or 'none'")
    return p


def _workload_config(args: argparse.Namespace, requests: int, seed: int) -> WorkloadConfig:
    keys = args.api_keys or [os.environ.get("LLMSERVE_API_KEY", "dev-key")]
    weights = _levels(args.tenant_weights, float) if args.tenant_weights else None
    if weights is not None and len(weights) != len(keys):
        raise UsageError("--tenant-weights needs one weight per --api-key")
    return WorkloadConfig(requests=requests, prompt_tokens=parse_dist(args.prompt_tokens),
                          output_tokens=parse_dist(args.output_tokens), api_keys=keys,
                          tenant_weights=weights, seed=seed)


def _run_settings(args: argparse.Namespace) -> RunSettings:
    root = Path(args.root_cert).read_bytes() if args.root_cert else None
    return RunSettings(target=args.target, model=args.model, temperature=args.temperature,
                       timeout_s=args.timeout, chat=args.chat, tls=args.tls, root_cert=root,
                       slo=Targets(args.slo_ttft_ms, args.slo_tpot_ms))


async def _run_level(args: argparse.Namespace, mode: str, load: float, index: int) -> dict:
    settings = _run_settings(args)
    label = f"c={load}" if mode == "closed" else f"rate={load}"
    seed = args.seed + 1000 * index
    if args.warmup > 0:
        await run_closed(build_workload(_workload_config(args, args.warmup, seed + 999)), 1, settings)
    specs = build_workload(_workload_config(args, args.requests, seed))
    bar = tqdm(total=len(specs), desc=label, unit="req", disable=True if args.no_progress else None,
               file=sys.stderr, dynamic_ncols=True)
    errors = 0

    def progress(result: RequestResult) -> None:
        nonlocal errors
        errors += not result.ok
        bar.update(1)
        bar.set_postfix(errors=errors, refresh=False)

    urls = roofline.metrics_urls(args.worker_metrics, STATE_DIR / "logs")
    before = await asyncio.to_thread(roofline.scrape, urls)
    if mode == "closed":
        results, wall = await run_closed(specs, int(load), settings, progress)
    else:
        arrivals = poisson_arrivals(load, len(specs), random.Random(seed))
        results, wall = await run_open(specs, arrivals, settings, progress)
    bar.close()
    summary = summarize(results, wall)
    summary["goodput"] = summarize_goodput(results, settings.slo, wall)
    return {"load": load, "label": label, "summary": summary,
            "roofline": roofline.bandwidth(before, await asyncio.to_thread(roofline.scrape, urls))}


def _report(args: argparse.Namespace, mode: str, levels: list[dict]) -> dict:
    return {
        "mode": mode,
        "finished_at": dt.datetime.now(dt.UTC).isoformat(),
        "config": {"target": args.target, "tenants": len(args.api_keys or [None]), "requests": args.requests,
                   "warmup": args.warmup, "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "model": args.model, "temperature": args.temperature,
                   "chat": args.chat, "seed": args.seed, "timeout_s": args.timeout,
                   "worker_metrics": args.worker_metrics,
                   "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms},
        "levels": levels,
    }


def _plot_path(args: argparse.Namespace, levels: list[dict]) -> Path | None:
    if args.plot:
        return Path(args.plot)
    if args.output and len(levels) > 1:
        return Path(args.output).with_suffix(".png")
    return None


async def _run(args: argparse.Namespace) -> dict:
    mode = "open" if args.rate else "closed"
    loads = _levels(args.rate, float) if args.rate else _levels(args.concurrency or "1", int)
    if args.requests < 1 or args.warmup < 0:
        raise UsageError("--requests must be >= 1 and --warmup >= 0")
    _workload_config(args, 1, 0)   # fail on bad distributions/weights before any request is sent
    levels = [await _run_level(args, mode, load, i) for i, load in enumerate(loads)]
    return _report(args, mode, levels)


def main(argv: list[str] | None = None) -> int:
    """Run the load levels, print a table, write JSON/PNG; 0 on completion, 2 on bad usage."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(_run(args))
    except (UsageError, DistError) as exc:
        parser.print_usage(sys.stderr)
        print(f"llmserve bench: error: {exc}", file=sys.stderr)
        return 2
    print(report.format_table(result["levels"]))
    if args.output:
        report.write_json(Path(args.output), result)
        print(f"report: {args.output}")
    plot = _plot_path(args, result["levels"])
    if plot:
        report.plot_latency(plot, result["levels"], result["mode"])
        print(f"plot: {plot}")
    return 0
