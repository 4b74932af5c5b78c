"""A standard LLM benchmark tool (guidellm) against llmserve's OpenAI-compatible endpoint.

    pip install guidellm==0.8.1        # into any venv (the `bench` extra); it is not a test dependency
    .venv/bin/python bench/openai_standard.py --concurrency 1,4,16 --requests 24
    .venv/bin/python bench/openai_standard.py --target http://127.0.0.1:8000   # a stack already up

Without --target it starts its own stack (`Stack`, one CPU worker, HTTP on a free port). Per
concurrency level it runs `guidellm run` (synthetic prompts of --prompt-tokens, --output-tokens
with ignore_eos, closed loop of N streams, --requests requests), reads guidellm's JSON, and
reports guidellm's own TTFT, TPOT and ITL with output tokens/s, plus request goodput under the
SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms per request, from guidellm's per-request
figures). guidellm's definitions: TTFT = request start to the first token; ITL = mean gap
between tokens after the first; TPOT = mean time per output token over the whole request
(latency / output tokens, first token included). Writes bench/results/openai_standard.json and
.png. guidellm reads a Hugging Face tokenizer directory: one is written from the served GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmserve import model_store  # noqa: E402
from tokenizer_svc.loader import load_tokenizer  # noqa: E402

RESULTS = REPO / "bench" / "results"
MODEL = "smollm2-135m"


def tokenizer_dir(directory: Path) -> Path:
    """A Hugging Face tokenizer directory of the served model (guidellm counts tokens with it)."""
    model = load_tokenizer(model_store.fetch())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(model.to_json(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": model.chat_template,
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def run_level(guidellm: str, target: str, api_key: str, tokenizer: Path, streams: int, args, out: Path) -> dict:
    command = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={target},model={MODEL},api_key={api_key}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]
    print(f"guidellm: {streams} concurrent streams, {args.requests} requests", flush=True)
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.read_text())["benchmarks"][0]


def summarize(benchmark: dict, streams: int, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    metrics = benchmark["metrics"]
    done = benchmark["requests"]["successful"]

    def stat(name: str, key: str) -> float:
        value = metrics[name]["successful"]
        return value["percentiles"][key] if key.startswith("p") else value[key]

    good = [r for r in done
            if r["time_to_first_token_ms"] <= slo_ttft_ms and r["time_per_output_token_ms"] <= slo_tpot_ms]
    duration = benchmark["duration"]
    return {
        "concurrency": streams, "requests": len(done),
        "errors": len(benchmark["requests"].get("errored") or []),
        "ttft_ms_p50": stat("time_to_first_token_ms", "p50"), "ttft_ms_p99": stat("time_to_first_token_ms", "p99"),
        "tpot_ms_mean": stat("time_per_output_token_ms", "mean"), "itl_ms_p50": stat("inter_token_latency_ms", "p50"),
        "output_tok_s": sum(r["output_tokens"] for r in done) / duration,
        "requests_s": len(done) / duration,
        "goodput_share": len(good) / len(done) if done else 0.0,
        "goodput_requests_s": len(good) / duration,
    }


def plot(rows: list[dict], path: Path, slo: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [r["output_tok_s"] for r in rows], marker="o")
    left.set(xlabel="concurrent streams", ylabel="output tokens/s", title="llmserve via guidellm (OpenAI HTTP)")
    right.plot(levels, [r["requests_s"] for r in rows], marker="o", label="requests/s")
    right.plot(levels, [r["goodput_requests_s"] for r in rows], marker="s", label=f"goodput ({slo})")
    right.set(xlabel="concurrent streams", ylabel="requests/s")
    right.legend()
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="", help="base URL of a running endpoint (default: start a stack)")
    parser.add_argument("--api-key", default="dev-key")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=24, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--guidellm", default=os.environ.get("GUIDELLM", shutil.which("guidellm") or "guidellm"))
    args = parser.parse_args()

    stack = None
    if not args.target:
        from llmserve.stack import Stack, StackConfig

        print("starting a stack (1 CPU worker)...", flush=True)
        stack = Stack(StackConfig(workers=1, device="cpu", port=0, http_port=-1)).start()
        args.target = stack.http_url
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = tokenizer_dir(Path(tmp) / "tokenizer")
            for streams in (int(v) for v in args.concurrency.split(",")):
                benchmark = run_level(args.guidellm, args.target, args.api_key, tokenizer, streams, args,
                                      Path(tmp) / f"c{streams}.json")
                rows.append(summarize(benchmark, streams, args.slo_ttft_ms, args.slo_tpot_ms))
    finally:
        if stack is not None:
            stack.close()
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    print(f"\nguidellm against {args.target} (prompt {args.prompt_tokens}, output {args.output_tokens} tokens; {slo})")
    print("| streams | output tok/s | req/s | TTFT p50 / p99 (ms) | TPOT mean (ms) | ITL p50 (ms) | goodput | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} | {r['ttft_ms_p50']:.0f} / "
              f"{r['ttft_ms_p99']:.0f} | {r['tpot_ms_mean']:.0f} | {r['itl_ms_p50']:.0f} | "
              f"{r['goodput_share']:.0%} ({r['goodput_requests_s']:.2f} req/s) | {r['errors']} |")
    report = {"tool": "guidellm 0.8.1", "target": args.target, "slo": slo, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, "levels": rows}
    (RESULTS / "openai_standard.json").write_text(json.dumps(report, indent=2))
    plot(rows, RESULTS / "openai_standard.png", slo)
    print(f"wrote {RESULTS / 'openai_standard.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
