"""Soak run: a CPU (or GPU) stack under steady load, sampled for growth. Exit 1 when something leaked.

    .venv/bin/python bench/soak.py --duration 600 --concurrency 4 --output bench/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from llmserve.loadgen.soak import SoakConfig, soak
from llmserve.local.stack import Stack, StackConfig

REPO = Path(__file__).resolve().parent.parent
TENANTS = REPO / "tests" / "data" / "tenants.test.yaml"
EVENTS_TTL_S = "10"   # short, so per-request keys expire during the run and growth shows


def soak_stack_config(workers: int = 1, device: str = "cpu", log_dir: Path | None = None) -> StackConfig:
    ttl = ["--events-ttl-s", EVENTS_TTL_S]
    return StackConfig(workers=workers, device=device, port=0, tenants=TENANTS, log_dir=log_dir,
                       extra_flags={"gateway": ttl, "batcher": ttl, "gpu_worker": ttl})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--output", default="", help="write the samples and findings as JSON here")
    args = p.parse_args(argv)
    stack = Stack(soak_stack_config(args.workers, args.device)).start()
    try:
        report = asyncio.run(soak(stack, SoakConfig(duration_s=args.duration, concurrency=args.concurrency)))
    finally:
        stack.close()
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    s = report.summary
    print(f"{s['ok']}/{s['requests']} ok, {s['throughput']['output_tokens_per_s']:.1f} tok/s, "
          f"{len(report.samples)} samples; problems: {report.problems() or 'none'}")
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
