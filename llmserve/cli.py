"""The `llmserve` command: start the stack, call it, fetch the model, load-test it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from llmserve.catalog import model_store
from llmserve.local.stack import STATE_DIR
from llmserve.local.valkey import FSYNC_POLICIES

DEFAULT_TARGET = "127.0.0.1:50051"
DEV_API_KEY = "dev-key"  # the key of deploy/tenants.dev.yaml, for local use only
REDIS_URL_FILE = STATE_DIR / "redis-url"


def _up(args: argparse.Namespace) -> int:
    from llmserve.local.stack import DEFAULT_TENANTS, Stack, StackConfig
    from llmserve.local.supervisor import REFUSED_EXIT_CODE, Supervisor, refusal
    from llmserve.runtime.log import configure_logging

    configure_logging("llmserve-up")
    state_dir = STATE_DIR.resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else state_dir / "logs"
    models_file = Path(args.models).resolve() if args.models else None
    config = StackConfig(model=args.model, workers=args.workers, gateways=args.gateways, device=args.device,
                         models_file=models_file, quantization=args.quantization,
                         drain_timeout_s=args.drain_timeout_s,
                         port=args.port, http_port=args.http_port,
                         tenants=Path(args.tenants).resolve() if args.tenants else DEFAULT_TENANTS,
                         redis_url=os.environ.get("REDIS_URL") or None, redis_appendonly=True,
                         redis_fsync=args.redis_fsync, redis_dir=state_dir / "valkey", log_dir=log_dir)
    stop, roll = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: roll.set())
    what = f"models of {models_file}" if models_file else f"model {args.model}, {args.workers} worker(s)"
    print(f"starting llmserve ({what}, device {args.device}); logs in {log_dir}/", flush=True)
    stack = Stack(config)
    try:
        stack.start()
    except RuntimeError:                 # a child exited before SERVING (the stack is stopped)
        refused = [said for child in stack.services.values() if (said := refusal(child))]
        if not refused:
            raise
        print("\n".join(refused), file=sys.stderr, flush=True)
        return REFUSED_EXIT_CODE
    redis_url_file = _record_redis_url(state_dir, stack.redis_url)
    supervisor = Supervisor(stack, say=lambda text: print(text, file=sys.stderr, flush=True))
    try:
        print(f"\nllmserve is up: gateway at {stack.gateway_target}  (Redis {redact_url(stack.redis_url)})")
        if args.http_port:
            print(f"OpenAI-compatible HTTP at {stack.http_url}/v1")
        print(f'try:  llmserve generate "What is the capital of France?" --target {stack.gateway_target}')
        print("Ctrl-C stops everything gracefully; SIGHUP rolls the workers one at a time.", flush=True)
        while not stop.wait(0.5):
            if roll.is_set():
                roll.clear()
                supervisor.roll_workers()
            supervisor.poll()
    finally:
        print("stopping...", flush=True)
        supervisor.stop()
        codes = stack.stop()
        redis_url_file.unlink(missing_ok=True)
        print("stopped: " + ", ".join(f"{name}={code}" for name, code in codes.items()), flush=True)
    return 0


def _record_redis_url(state_dir: Path, url: str) -> Path:
    """.llmserve/redis-url, readable by this user only (the URL may carry a password)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / REDIS_URL_FILE.name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(url + "\n")
    return path


def admin_redis_url(flag: str | None) -> str:
    """--redis-url, else REDIS_URL, else the Redis `llmserve up` recorded in this directory."""
    url = flag or os.environ.get("REDIS_URL")
    if url:
        return url
    if REDIS_URL_FILE.exists():
        return REDIS_URL_FILE.read_text().strip()
    raise SystemExit(f"llmserve: no Redis to talk to: give --redis-url or REDIS_URL, or run this where "
                     f"`llmserve up` runs (it records its Redis in {REDIS_URL_FILE})")


def parse_targets(pairs: list[str]) -> dict[str, int]:
    """TARGET=WEIGHT arguments as a mapping; the weights' range is checked by llmserve.catalog.routes."""
    weights: dict[str, int] = {}
    for pair in pairs:
        target, sep, raw = pair.rpartition("=")
        if not sep or not target:
            raise SystemExit(f"llmserve route: {pair!r} is not TARGET=WEIGHT")
        if target in weights:
            raise SystemExit(f"llmserve route: {target} given twice")
        try:
            weights[target] = int(raw)
        except ValueError:
            raise SystemExit(f"llmserve route: weight of {target} must be an integer, not {raw!r}") from None
    return weights


def _route(args: argparse.Namespace) -> int:
    from llmserve.catalog import routes
    from llmserve.catalog.models_file import ModelsFileError
    from llmserve.runtime import redis_client

    client = redis_client.connect_sync(admin_redis_url(args.redis_url))
    try:
        if args.targets:
            try:
                weights = routes.set_weights(client, args.alias, parse_targets(args.targets))
            except ModelsFileError as exc:
                print(f"llmserve route: {exc}", file=sys.stderr)
                return 2
        else:
            stored = routes.get_weights(client, args.alias)
            if stored is None:
                print(f"llmserve route: no weights for alias {args.alias!r}", file=sys.stderr)
                return 1
            weights = stored
    finally:
        client.close()
    total = sum(weights.values()) or 1
    print(f"{args.alias}:")
    for target, weight in sorted(weights.items()):
        print(f"  {target}={weight}  ({100 * weight / total:.1f} %)")
    return 0


def redact_url(url: str) -> str:
    """The URL without its password, for printing."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _generate(args: argparse.Namespace) -> int:
    from llmserve.client import Client

    client = Client(args.target, api_key=args.api_key, tls=args.tls, root_cert=args.root_cert)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                  timeout=args.timeout)
    if args.raw:
        kwargs["prompt"] = args.prompt
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        kwargs["messages"] = [*messages, {"role": "user", "content": args.prompt}]
    last = None
    for chunk in client.generate(**kwargs):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    if last is not None and last.usage is not None and args.verbose:
        print(f"[{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} completion tokens, "
              f"ttft {last.usage.ttft_ms:.0f} ms, total {last.usage.total_ms:.0f} ms]", file=sys.stderr)
    return 0


def _fetch_model(args: argparse.Namespace) -> int:
    print(model_store.resolve(args.model))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from llmserve.loadgen import main as loadgen_main

    return loadgen_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM serving over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis (unless REDIS_URL is set) and every service")
    up.add_argument("--port", type=int, default=50051, help="gateway port")
    up.add_argument("--http-port", type=int, default=8000,
                    help="OpenAI-compatible HTTP port of the first gateway (0 = off, -1 = a free one)")
    up.add_argument("--tenants", default="", help="tenants YAML file (default: the dev tenants, key dev-key)")
    up.add_argument("--workers", type=int, default=1, help="number of gpu_worker processes")
    up.add_argument("--gateways", type=int, default=1, help="number of gateway processes")
    up.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    up.add_argument("--model", default=model_store.DEFAULT_MODEL, help="model path or smollm2-135m")
    up.add_argument("--models", default=os.environ.get("LLMSERVE_MODELS", ""),
                    help="models file: versions NAME@VERSION with workers, aliases with weights, a default "
                         "(env LLMSERVE_MODELS); replaces --model and --workers")
    up.add_argument("--quantization", default="",
                    help="workers' weight format (see python -m gpu_worker --help); default: the worker's")
    up.add_argument("--drain-timeout-s", type=float, default=None,
                    help="seconds a draining worker (SIGTERM, SIGHUP roll) finishes running sequences before "
                         "it hands the rest to another worker (default: the worker's, 30)")
    up.add_argument("--log-dir", default="", help="where service logs go (default .llmserve/logs)")
    up.add_argument("--redis-fsync", choices=FSYNC_POLICIES, default="everysec",
                    help="appendfsync of the Valkey `up` starts: everysec (a machine crash may lose the last "
                         "second of writes) or always (none, slower writes); see docs/durability.md")
    up.set_defaults(func=_up)

    route = sub.add_parser("route", help="show or set, fleet-wide, the weights of an alias's versions")
    route.add_argument("alias")
    route.add_argument("targets", nargs="*", metavar="TARGET=WEIGHT",
                       help="e.g. smollm2-135m@v1=100 (omitted targets get no traffic); none: print the weights")
    route.add_argument("--redis-url", default=None,
                       help="Redis URL (default: REDIS_URL, else the Redis `llmserve up` recorded in .llmserve/)")
    route.set_defaults(func=_route)

    gen = sub.add_parser("generate", help="stream an answer from the gateway")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=os.environ.get("LLMSERVE_TARGET", DEFAULT_TARGET))
    gen.add_argument("--api-key", default=os.environ.get("LLMSERVE_API_KEY", DEV_API_KEY))
    gen.add_argument("--system", default="", help="system prompt")
    gen.add_argument("--raw", action="store_true", help="send as a plain prompt, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    gen.add_argument("--tls", action="store_true")
    gen.add_argument("--root-cert", default=None)
    gen.add_argument("-v", "--verbose", action="store_true", help="print usage after the answer")
    gen.set_defaults(func=_generate)

    fetch = sub.add_parser("fetch-model", help="download the model into the cache and print its path")
    fetch.add_argument("--model", default=model_store.DEFAULT_MODEL)
    fetch.set_defaults(func=_fetch_model)

    bench = sub.add_parser("bench", help="run the load generator (see `llmserve bench --help`)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER rejects options right after the subcommand; hand them over untouched.
        return _bench(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
