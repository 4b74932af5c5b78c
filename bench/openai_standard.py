"""A standard LLM benchmark tool (guidellm) against llmserve's OpenAI-compatible endpoint.

    pip install guidellm==0.8.1        # into any venv (the `bench` extra); it is not a test dependency
    .venv/bin/python bench/openai_standard.py --concurrency 1,4,16 --requests 24
    .venv/bin/python bench/openai_standard.py --target http://127.0.0.1:8000   # a stack already up
    .venv/bin/python bench/openai_standard.py --concurrency 1,4,16,32 --requests 16 \
        --llama-server /path/to/llama-server          # llama.cpp on the same GGUF, same run, ratios

Without --target it starts its own stack (`Stack`, one CPU worker, HTTP on a free port); with
--llama-server it also measures llama.cpp's server on the same GGUF (one server at a time, in the
order --baseline-first picks) and prints both with their ratio. Per
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
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmserve import model_store  # noqa: E402
from llmserve.valkey import free_port  # noqa: E402
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


def plot(results: dict[str, list[dict]], path: Path, slo: str) -> None:
    """Output tok/s per level for each server measured (left), requests/s and goodput (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for color, (name, rows) in enumerate(results.items()):
        levels = [r["concurrency"] for r in rows]
        left.plot(levels, [r["output_tok_s"] for r in rows], marker="o", color=f"C{color}", label=name)
        right.plot(levels, [r["requests_s"] for r in rows], marker="o", color=f"C{color}", label=f"{name} requests/s")
        right.plot(levels, [r["goodput_requests_s"] for r in rows], marker="s", linestyle="--", color=f"C{color}",
                   label=f"{name} goodput")
    left.set(xlabel="concurrent streams", ylabel="output tokens/s", title="guidellm over OpenAI HTTP")
    right.set(xlabel="concurrent streams", ylabel="requests/s", title=f"goodput: {slo}")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class LlamaServer:
    """llama.cpp's `llama-server` on the same GGUF, the baseline a user would pick instead: one slot
    of `slot_tokens` per stream of the highest level, 2 threads (this project's CPU worker size), on a
    free port."""

    def __init__(self, binary: str, gguf: Path, parallel: int, slot_tokens: int, threads: int, log: Path) -> None:
        self.port = free_port()
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [binary, "-m", str(gguf), "--parallel", str(parallel), "-c", str(slot_tokens * parallel),
             "-t", str(threads), "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server not ready after {timeout_s:.0f} s; see {self.log.name}")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def measure(name: str, args, levels: list[int], tokenizer: Path, tmp: Path) -> list[dict]:
    """Every level against one server: `llmserve` (a stack started here, or --target), or `llama-server`."""
    server = stack = None
    try:
        if name == "llama-server":
            # guidellm's prompts run past --prompt-tokens once templated (158 for 128): room for twice
            slot_tokens = 2 * args.prompt_tokens + args.output_tokens
            server = LlamaServer(args.llama_server, model_store.fetch(), max(levels), slot_tokens,
                                 args.llama_threads, RESULTS / "llama_server.log")
            server.wait_ready()
            target = server.url
        elif args.target:
            target = args.target
        else:
            from llmserve.stack import Stack, StackConfig

            print("starting a stack (1 CPU worker)...", flush=True)
            stack = Stack(StackConfig(workers=1, device="cpu", port=0, http_port=-1)).start()
            target = stack.http_url
        return [summarize(run_level(args.guidellm, target, args.api_key, tokenizer, streams, args,
                                    tmp / f"{name}-c{streams}.json"), streams, args.slo_ttft_ms, args.slo_tpot_ms)
                for streams in levels]
    finally:
        for running in (server, stack):
            if running is not None:
                running.close()


def print_levels(name: str, rows: list[dict], args, slo: str) -> None:
    print(f"\n{name} via guidellm (prompt {args.prompt_tokens}, output {args.output_tokens} tokens; {slo})")
    print("| streams | output tok/s | req/s | TTFT p50 / p99 (ms) | TPOT mean (ms) | ITL p50 (ms) | goodput | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} | {r['ttft_ms_p50']:.0f} / "
              f"{r['ttft_ms_p99']:.0f} | {r['tpot_ms_mean']:.0f} | {r['itl_ms_p50']:.0f} | "
              f"{r['goodput_share']:.0%} ({r['goodput_requests_s']:.2f} req/s) | {r['errors']} |")


def print_ratios(baseline: list[dict], ours: list[dict]) -> None:
    print("\nllmserve against llama-server, same run (output tok/s; ratio = llmserve / llama-server)")
    print("| streams | llama-server tok/s | llmserve tok/s | ratio | ITL p50 ms (llama / llmserve) |"
          " TTFT p50 ms (llama / llmserve) |")
    print("|---|---|---|---|---|---|")
    for b, o in zip(baseline, ours):
        print(f"| {o['concurrency']} | {b['output_tok_s']:.1f} | {o['output_tok_s']:.1f} | "
              f"{o['output_tok_s'] / b['output_tok_s']:.2f} | {b['itl_ms_p50']:.0f} / {o['itl_ms_p50']:.0f} | "
              f"{b['ttft_ms_p50']:.0f} / {o['ttft_ms_p50']:.0f} |")


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
    parser.add_argument("--llama-server", default="", help="path of llama.cpp's llama-server: measure it on the "
                        "same GGUF in the same run, one server after the other (README says how to build it)")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--baseline-first", action="store_true", help="measure llama-server before llmserve")
    args = parser.parse_args()

    levels = [int(v) for v in args.concurrency.split(",")]
    order = ["llmserve"]
    if args.llama_server:
        order = ["llama-server", "llmserve"] if args.baseline_first else ["llmserve", "llama-server"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tokenizer_dir(Path(tmp) / "tokenizer")
        results = {name: measure(name, args, levels, tokenizer, Path(tmp)) for name in order}
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    for name in sorted(results):
        print_levels(name, results[name], args, slo)
    if "llama-server" in results:
        print_ratios(results["llama-server"], results["llmserve"])
    report = {"tool": "guidellm 0.8.1", "target": args.target or "a stack started here", "slo": slo,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "order": order,
              "levels": results["llmserve"], **({"llama_server": results["llama-server"]}
                                                if "llama-server" in results else {})}
    (RESULTS / "openai_standard.json").write_text(json.dumps(report, indent=2))
    plot(results, RESULTS / "openai_standard.png", slo)
    print(f"wrote {RESULTS / 'openai_standard.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
