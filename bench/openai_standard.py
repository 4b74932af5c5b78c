"""A standard LLM benchmark tool (guidellm) against llmserve's OpenAI-compatible endpoint.

    pip install guidellm==0.8.1        # into any venv (the `bench` extra); it is not a test dependency
    .venv/bin/python bench/openai_standard.py --concurrency 1,4,16 --requests 24
    .venv/bin/python bench/openai_standard.py --target http://127.0.0.1:8000   # a stack already up
    .venv/bin/python bench/openai_standard.py --concurrency 1,4,16,32 --requests 16 \
        --llama-server /path/to/llama-server --order both    # llama.cpp on the same GGUF, same run, ratios
    .venv/bin/python bench/openai_standard.py --distinct-prompts --prompt-tokens 1500 --concurrency 1,8 \
        --requests 8 --llama-server /path/to/llama-server    # long-prompt mode

Without --target it starts its own stack (`Stack`, one CPU worker, HTTP on a free port); with
--llama-server it also measures llama.cpp's server on the same GGUF, one server at a time, in the
order --order picks (`both`: llama-server then llmserve, then llmserve then llama-server). Each
server gets a warm-up (--warmup-requests at 1 stream, not measured) before its levels. Per
concurrency level it runs `guidellm run` (synthetic prompts of --prompt-tokens, --output-tokens
with ignore_eos, closed loop of N streams, --requests requests), reads guidellm's JSON, and
reports guidellm's own TTFT, TPOT and ITL with output tokens/s, plus request goodput under the
SLO (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms per request, from guidellm's per-request
figures). guidellm's definitions: TTFT = request start to the first token; ITL = mean gap
between tokens after the first; TPOT = mean time per output token over the whole request
(latency / output tokens, first token included). guidellm reads a Hugging Face tokenizer
directory: one is written from the served GGUF.

Prompts: by default chat messages (/v1/chat/completions), so every prompt starts with the chat
template's shared system prefix. With --distinct-prompts (the long-prompt mode) they go as raw text
to /v1/completions: guidellm starts each synthetic prompt with a counter, so no two of one guidellm
run share a first token. guidellm draws the same prompts for the same seed, so every guidellm run
here gets its own (`prompt_seed`): a level never replays the warm-up's prompts or an earlier level's,
and neither server's prefix cache serves any of it. Both servers of a pass get the same seeds, so they
answer the same prompts.

Writes one JSON file a run, bench/results/openai_standard/<UTC date>-<prompts>-p<tokens>.json: the
machine (CPU model, the kernel-relevant flags, CPU count), llama-server's version, system info and
build options, the command line, the date, the model file with a sha256 prefix, the workload, and
per pass and server the figures of every level. Commit the files the docs quote; `bench/report.py`
renders docs/performance.md's tables from them. A plot of the same name (.png) is not committed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import report  # noqa: E402
from llmserve.catalog import model_store  # noqa: E402
from llmserve.local.valkey import free_port  # noqa: E402
from tokenizer_svc.loader import load_tokenizer  # noqa: E402

RESULTS = REPO / "bench" / "results"
RUNS = RESULTS / "openai_standard"
MODEL = "smollm2-135m"
SCHEMA = "llmserve.bench.openai_standard/1"
ORDERS = {"llmserve-first": [["llmserve", "llama-server"]], "llama-first": [["llama-server", "llmserve"]],
          "both": [["llama-server", "llmserve"], ["llmserve", "llama-server"]]}
# CPU flags the kernels (ours and llama.cpp's) choose code paths by
KERNEL_FLAGS = re.compile(r"^(avx2|fma|f16c|avx_vnni\w*|avx512\w*|amx\w*)$")
# llama.cpp's CMake options that pick its CPU code paths (the cache holds every backend's options too)
BUILD_OPTIONS = re.compile(r"^(GGML_(?:NATIVE|CPU\w*|AVX\w*|AMX\w*|FMA|F16C|BMI2|SSE42|OPENMP|LLAMAFILE)"
                           r"|CMAKE_BUILD_TYPE):\w+=(.*)$")


def tokenizer_dir(directory: Path, gguf: Path) -> Path:
    """A Hugging Face tokenizer directory of the served model (guidellm counts tokens with it)."""
    model = load_tokenizer(gguf)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(model.to_json(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": model.chat_template,
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def request_format(args: argparse.Namespace) -> str:
    return "/v1/completions" if args.distinct_prompts else "/v1/chat/completions"


def sampling_extras(args: argparse.Namespace) -> str:
    """guidellm backend keys that put --temperature in every request body ('' = each server's default)."""
    return "" if args.temperature is None else f",extras.body.temperature={args.temperature}"


def prompt_seed(pass_number: int, run: int) -> int:
    """guidellm's seed for a server's `run`-th guidellm run (0: the warm-up) in pass `pass_number`: the
    same for both servers of a pass, different for every other run of the bench."""
    return 1000 * pass_number + run


def run_level(target: str, tokenizer: Path, streams: int, requests: int, seed: int, args: argparse.Namespace,
              out: Path) -> dict:
    """One `guidellm run` of `requests` requests over `streams` closed-loop streams, its prompts drawn
    with `seed`; guidellm's benchmark."""
    command = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={target},model={MODEL},api_key={args.api_key},"
                     f"request_format={request_format(args)}{sampling_extras(args)}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--seed", f"kind=static,value={seed}",
        # one prompt ahead: guidellm's default (4096) has its data process write thousands of prompts while
        # the server is measured, a busy core taken from a 2-core machine's server for the run's first half
        # minute (TTFT of 1,500-token prompts 4.2-5.5 s against 2.7-3.0 s with one ahead, 2026-12-07)
        "--data-loader", "kind=pytorch,prefetch_factor=1",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]
    print(f"guidellm: {streams} concurrent streams, {requests} requests", flush=True)
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.read_text())["benchmarks"][0]


def summarize(benchmark: dict, streams: int, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """One level's figures from guidellm's benchmark: latencies in ms, throughput per second of the run."""
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
        "output_tok_s": sum(r["output_tokens"] for r in done) / duration,
        "requests_s": len(done) / duration,
        **{f"{short}_ms_{p}": stat(name, p) for short, name in (("ttft", "time_to_first_token_ms"),
                                                                ("itl", "inter_token_latency_ms"))
           for p in ("p50", "p95", "p99")},
        "tpot_ms_mean": stat("time_per_output_token_ms", "mean"),
        "goodput_share": len(good) / len(done) if done else 0.0,
        "goodput_requests_s": len(good) / duration,
    }


def parse_cpuinfo(text: str) -> dict:
    """CPU model, kernel-relevant flags and logical CPU count from /proc/cpuinfo's text."""
    fields = [line.partition(":") for line in text.splitlines()]
    model = next((value.strip() for key, _, value in fields if key.strip() == "model name"), "unknown")
    flags = next((value.split() for key, _, value in fields if key.strip() == "flags"), [])
    return {"cpu_model": model, "cpu_flags": sorted({f for f in flags if KERNEL_FLAGS.match(f)}),
            "logical_cpus": sum(1 for key, _, _ in fields if key.strip() == "processor")}


def machine_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """This machine as a result file names it; lscpu's model name where there is no /proc/cpuinfo."""
    if cpuinfo.exists():
        info = parse_cpuinfo(cpuinfo.read_text())
    else:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = re.search(r"^Model name:\s*(.+)$", lscpu, re.MULTILINE)
        info = {"cpu_model": model.group(1) if model else "unknown", "cpu_flags": [], "logical_cpus": os.cpu_count()}
    return {**info, "usable_cpus": len(os.sched_getaffinity(0))}


def model_identity(path: Path) -> dict:
    """The served file's name and the first 16 hex digits of its sha256."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"file": path.name, "sha256_prefix": digest.hexdigest()[:16]}


def cmake_options(binary: Path) -> str:
    """llama.cpp's CPU build options from the CMakeCache.txt of the build the binary is in (build/bin/x)."""
    cache = binary.resolve().parent.parent / "CMakeCache.txt"
    if not cache.exists():
        return ""
    found = (BUILD_OPTIONS.match(line) for line in cache.read_text(errors="replace").splitlines())
    return " ".join(f"{m.group(1)}={m.group(2)}" for m in found if m)


class LlamaServer:
    """llama.cpp's `llama-server` on the same GGUF, the baseline a user would pick instead: one slot
    of `slot_tokens` per stream of the highest level, --llama-threads threads (2: this project's CPU
    worker size) and any --llama-args, on a free port."""

    def __init__(self, binary: str, gguf: Path, parallel: int, slot_tokens: int, args: argparse.Namespace,
                 log: Path) -> None:
        self.port = free_port()
        self.command = [binary, "-m", str(gguf), "--parallel", str(parallel), "-c", str(slot_tokens * parallel),
                        "-t", str(args.llama_threads), *shlex.split(args.llama_args),
                        "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = log.open("w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)

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

    def system_info(self) -> str:
        """The `system_info:` line llama-server logs at start (threads and the CPU features it uses)."""
        lines = Path(self.log.name).read_text(errors="replace").splitlines()
        return next((line.strip() for line in lines if "system_info" in line), "")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def llama_build(args: argparse.Namespace) -> dict:
    """What a llama-server figure was built from: `--version`'s text and the CPU build options."""
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, check=False)
    return {"binary": args.llama_server, "version": (version.stdout + version.stderr).strip(),
            "build_options": args.llama_build_options or cmake_options(Path(args.llama_server)) or "unknown"}


def measure(name: str, args: argparse.Namespace, levels: list[int], pass_number: int, tokenizer: Path, tmp: Path,
            seen: dict) -> list[dict]:
    """A warm-up, then every level, against one server in pass `pass_number`: `llmserve` (a stack started
    here, or --target) or `llama-server`. Puts what the server told about itself (llama-server's command line and
    system info) in `seen`."""
    server = stack = None
    try:
        if name == "llama-server":
            # guidellm's chat prompts run past --prompt-tokens once templated (158 for 128): room for twice
            slot_tokens = 2 * args.prompt_tokens + args.output_tokens
            server = LlamaServer(args.llama_server, model_store.resolve(args.model), max(levels), slot_tokens, args,
                                 RESULTS / "llama_server.log")
            server.wait_ready()
            target = server.url
        elif args.target:
            target = args.target
        else:
            from llmserve.local.stack import Stack, StackConfig

            print("starting a stack (1 CPU worker)...", flush=True)
            served = f"{MODEL}={model_store.resolve(args.model)}"   # one model id for both servers
            stack = Stack(StackConfig(model=served, workers=1, device="cpu", port=0, http_port=-1)).start()
            target = stack.http_url
        if args.warmup_requests:
            print(f"warm-up of {name}", flush=True)
            run_level(target, tokenizer, 1, args.warmup_requests, prompt_seed(pass_number, 0), args,
                      tmp / f"{name}-warmup.json")
        if server is not None:
            seen.update(command=shlex.join(server.command), system_info=server.system_info())
        return [summarize(run_level(target, tokenizer, streams, args.requests, prompt_seed(pass_number, run), args,
                                    tmp / f"{name}-c{streams}.json"), streams, args.slo_ttft_ms, args.slo_tpot_ms)
                for run, streams in enumerate(levels, 1)]
    finally:
        for running in (server, stack):
            if running is not None:
                running.close()


def run_record(args: argparse.Namespace, argv: list[str], machine: dict, model: dict, llama: dict | None,
               passes: list[dict], date: datetime) -> dict:
    """The JSON document of one run: where and how it ran, then every pass's figures per server."""
    return {
        "schema": SCHEMA,
        "date": date.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(argv),
        "machine": machine,
        "model": model,
        "workload": {"tool": "guidellm 0.8.1", "prompts": "distinct" if args.distinct_prompts else "chat",
                     "request_format": request_format(args), "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "requests": args.requests,
                     "temperature": "each server's default" if args.temperature is None else args.temperature,
                     "warmup_requests": args.warmup_requests,
                     "prompt_seeds": "guidellm --seed 1000 * pass + run (run 0: the warm-up), both servers alike",
                     "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
                     "target": args.target or "a stack started here (1 CPU worker, defaults)"},
        "llama_server": llama,
        "passes": passes,
    }


def write_result(record: dict, directory: Path = RUNS) -> Path:
    """Write one run's record as <date>-<prompts>-p<prompt tokens>.json under `directory`."""
    stamp = record["date"].replace(":", "").replace("-", "")
    workload = record["workload"]
    path = directory / f"{stamp}-{workload['prompts']}-p{workload['prompt_tokens']}.json"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def plot(passes: list[dict], path: Path, slo: str) -> None:
    """Output tok/s per level for each server and pass (left), requests/s and goodput (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    curves = [(f"{name} (pass {i + 1})", rows) for i, p in enumerate(passes) for name, rows in p["servers"].items()]
    for color, (label, rows) in enumerate(curves):
        levels = [r["concurrency"] for r in rows]
        left.plot(levels, [r["output_tok_s"] for r in rows], marker="o", color=f"C{color}", label=label)
        right.plot(levels, [r["requests_s"] for r in rows], marker="o", color=f"C{color}", label=f"{label} requests/s")
        right.plot(levels, [r["goodput_requests_s"] for r in rows], marker="s", linestyle="--", color=f"C{color}",
                   label=f"{label} goodput")
    left.set(xlabel="concurrent streams", ylabel="output tokens/s", title="guidellm over OpenAI HTTP")
    right.set(xlabel="concurrent streams", ylabel="requests/s", title=f"goodput: {slo}")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_levels(name: str, rows: list[dict], args: argparse.Namespace, slo: str) -> None:
    print(f"\n{name} via guidellm (prompt {args.prompt_tokens}, output {args.output_tokens} tokens; {slo})")
    print("| streams | output tok/s | req/s | TTFT p50 / p95 (ms) | TPOT mean (ms) | ITL p50 / p95 (ms) | goodput | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} | {r['ttft_ms_p50']:.0f} / "
              f"{r['ttft_ms_p95']:.0f} | {r['tpot_ms_mean']:.0f} | {r['itl_ms_p50']:.0f} / {r['itl_ms_p95']:.0f} | "
              f"{r['goodput_share']:.0%} ({r['goodput_requests_s']:.2f} req/s) | {r['errors']} |")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="", help="base URL of a running endpoint that serves the model id "
                        f"{MODEL} (`llmserve up --model {MODEL}=PATH`; default: start a stack)")
    parser.add_argument("--api-key", default="dev-key")
    parser.add_argument("--model", default=MODEL, help="the GGUF both servers serve: a path, or the default "
                        f"{MODEL} (a SmolLM2 file: the bench's tokenizer directory names its special tokens)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=24, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature every request "
                        "asks both servers for (0: greedy; default: none sent, each server samples with its own)")
    parser.add_argument("--distinct-prompts", action="store_true", help="long-prompt mode: raw-text prompts to "
                        "/v1/completions, no two sharing a first token (use with --prompt-tokens 1500)")
    parser.add_argument("--warmup-requests", type=int, default=4, help="unmeasured requests at 1 stream before "
                        "each server's levels (0: none)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--guidellm", default=os.environ.get("GUIDELLM", shutil.which("guidellm") or "guidellm"))
    parser.add_argument("--llama-server", default="", help="path of llama.cpp's llama-server: measure it on the "
                        "same GGUF in the same run, one server after the other (docs/performance.md says how to build it)")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--poll 0 -ub 512 -b 2048'")
    parser.add_argument("--llama-build-options", default="", help="how llama-server was built, e.g. its cmake -D "
                        "options (default: read from the CMakeCache.txt of the build the binary is in)")
    parser.add_argument("--order", choices=sorted(ORDERS), default="llmserve-first",
                        help="which server runs first with --llama-server; both: one pass in each order")
    return parser.parse_args(argv)


def missing_tool(args: argparse.Namespace) -> str:
    """Why the run cannot start ('' when it can): checked before any server starts, as a missing tool
    otherwise fails the run minutes in, after the first server's warm-up."""
    if shutil.which(args.guidellm) is None:
        return (f"guidellm not found ({args.guidellm}): pip install guidellm==0.8.1 (the bench extra), "
                "or name it with --guidellm or GUIDELLM")
    if args.llama_server and shutil.which(args.llama_server) is None:
        return f"--llama-server {args.llama_server} is not an executable file"
    return ""


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if problem := missing_tool(args):
        sys.exit(f"openai_standard.py: {problem}")
    levels = [int(v) for v in args.concurrency.split(",")]
    orders = ORDERS[args.order] if args.llama_server else [["llmserve"]]
    llama = llama_build(args) if args.llama_server else None
    RESULTS.mkdir(parents=True, exist_ok=True)
    passes: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tokenizer_dir(Path(tmp) / "tokenizer", model_store.resolve(args.model))
        for pass_number, order in enumerate(orders, 1):
            seen: dict = {}
            passes.append({"order": order, "servers": {name: measure(name, args, levels, pass_number, tokenizer,
                                                                     Path(tmp), seen) for name in order}})
            if llama is not None:
                llama.update(seen)
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    for number, done in enumerate(passes, 1):
        print(f"\npass {number}: {' then '.join(done['order'])}")
        for name, rows in done["servers"].items():
            print_levels(name, rows, args, slo)
    record = run_record(args, [f"bench/{Path(__file__).name}", *argv], machine_info(),
                        model_identity(model_store.resolve(args.model)), llama, passes, datetime.now(UTC))
    path = write_result(record)
    plot(passes, path.with_suffix(".png"), slo)
    print(f"\n{report.render_run(path.name, record)}\n\nwrote {path.relative_to(REPO)} (and .png); "
          "commit it and run `python bench/report.py` to regenerate docs/performance.md's tables")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
