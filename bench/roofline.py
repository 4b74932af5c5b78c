"""The roofline figure: how close the worker's steps run to the machine's memory bandwidth, at 1 and
16 streams, on the real stack with SmolLM2 (gpu_worker/roofline.py is the meter).

    .venv/bin/python bench/roofline.py                       # 1 and 16 streams, writes the JSON below
    .venv/bin/python bench/roofline.py --concurrency 1,4,16 --requests 16 --notes "quiet machine"

Starts a stack of one worker (`Stack`, --device, the default quantization), runs `llmserve bench`'s
closed loop at each level against its gateway with the worker's metrics scraped before and after,
and writes bench/results/roofline/<UTC date>.json: the machine (CPU model, CPU counts), the model
file and the bytes of weights one step reads (loaded here the way the worker loads it), and per
level tok/s, the worker's probed GB/s, the achieved GB/s over the level's busy step time and its
fraction of the probe, and the best GB/s this process probed for --probe-seconds just before the
level (on a shared machine one short probe can land in a busy moment) with the fraction of the better
of the two. --notes is kept in the file: say there what else loaded the machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.openai_standard import machine_info, model_identity  # noqa: E402
from llmserve.catalog import model_store  # noqa: E402
from llmserve.loadgen import main as bench_main  # noqa: E402

RUNS = REPO / "bench" / "results" / "roofline"
SCHEMA = "llmserve.bench.roofline/1"
MODEL = "smollm2-135m"


def weights_read_per_step(device: str) -> int:
    """Bytes of weights one step of the worker's model reads (the worker's defaults: quantization auto)."""
    from gpu_worker.model.loader import load_model
    from gpu_worker.ops import select_device
    from gpu_worker.roofline import weight_bytes

    return weight_bytes(load_model(MODEL, select_device(device), quantization="auto"))


def best_probe(device: str, seconds: float) -> float:
    """The best of the worker's probe repeated for `seconds` in this process, GB/s: on a shared machine
    one short probe can land in a busy moment, so the bench looks longer than a worker's start-up can."""
    from gpu_worker.ops import select_device
    from gpu_worker.roofline import probe_bandwidth

    best, deadline = 0.0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        best = max(best, probe_bandwidth(select_device(device)).gbps)
    return best


def run_levels(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """A stack of one worker; `llmserve bench` at each level against it, each level's report with the
    bandwidth this process probed just before it (how much the machine's speed drifted since the
    worker's own probe at start)."""
    from llmserve.local.stack import Stack, StackConfig

    stack = Stack(StackConfig(workers=1, device=args.device, port=0)).start()
    levels = []
    try:
        metrics_port = stack.services["gpu_worker-0"].metrics_port_path.read_text().strip()
        for streams in args.concurrency.split(","):
            out = tmp / f"c{streams}.json"
            probe = best_probe(args.device, args.probe_seconds)
            code = bench_main(["--target", stack.gateway_target, "--concurrency", streams,
                               "--requests", str(args.requests), "--warmup", str(args.warmup),
                               "--prompt-tokens", args.prompt_tokens, "--output-tokens", args.output_tokens,
                               "--worker-metrics", f"127.0.0.1:{metrics_port}", "--no-progress", "--output", str(out)])
            if code != 0:
                raise SystemExit(f"llmserve bench failed with {code}")
            levels += [{**level, "probe_before_level_gbps": probe} for level in json.loads(out.read_text())["levels"]]
    finally:
        stack.close()
    return levels


def level_row(level: dict) -> dict:
    """One level's figures; `fraction` is of the worker's own best probe (what it exports), and
    `fraction_of_best_probe` of the best of that and the probe before the level."""
    meter, throughput = level["roofline"] or {}, level["summary"]["throughput"]
    best = max(meter.get("probe_gbps") or 0.0, level["probe_before_level_gbps"])
    return {"streams": level["load"], "ok": level["summary"]["ok"], "requests": level["summary"]["requests"],
            "output_tok_s": throughput["output_tokens_per_s"], "probe_gbps": meter.get("probe_gbps"),
            "probe_before_level_gbps": level["probe_before_level_gbps"],
            "achieved_gbps": meter.get("achieved_gbps"), "fraction": meter.get("fraction"),
            "fraction_of_best_probe": meter["achieved_gbps"] / best if meter and best > 0 else None,
            "steps": meter.get("steps"), "step_bytes": meter.get("step_bytes"),
            "step_seconds": meter.get("step_seconds")}


def record(args: argparse.Namespace, argv: list[str], levels: list[dict], weights: int, date: datetime) -> dict:
    return {
        "schema": SCHEMA,
        "date": date.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(argv),
        "machine": machine_info(),
        "model": model_identity(model_store.fetch()),
        "device": args.device,
        "weight_bytes_per_step": weights,
        "workload": {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                     "requests": args.requests, "warmup_requests": args.warmup, "temperature": 1.0},
        "levels": [level_row(level) for level in levels],
        "notes": args.notes,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,16", help="comma list of closed-loop stream counts")
    p.add_argument("--requests", type=int, default=32, help="measured requests a level")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each level")
    p.add_argument("--prompt-tokens", default="64", help="as llmserve bench takes it")
    p.add_argument("--output-tokens", default="64", help="as llmserve bench takes it")
    p.add_argument("--device", default="cpu", help="the worker's --device")
    p.add_argument("--probe-seconds", type=float, default=3.0, help="how long to probe before each level")
    p.add_argument("--notes", default="", help="kept in the result: what else ran on the machine")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmserve-roofline-") as tmp:
        levels = run_levels(args, Path(tmp))
    result = record(args, [f"bench/{Path(__file__).name}", *argv], levels, weights_read_per_step(args.device),
                    datetime.now(UTC))
    RUNS.mkdir(parents=True, exist_ok=True)
    path = RUNS / f"{result['date'].replace(':', '').replace('-', '')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["levels"]:
        print(f"{row['streams']:>3} streams: {row['output_tok_s']:.1f} tok/s, achieved {row['achieved_gbps']:.2f} GB/s "
              f"of the worker's {row['probe_gbps']:.2f} probed ({row['fraction']:.2f}); "
              f"{row['probe_before_level_gbps']:.2f} GB/s probed before the level "
              f"({row['fraction_of_best_probe']:.2f} of the better probe)")
    print(f"result: {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
