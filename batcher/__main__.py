"""`python -m batcher`: the dynamic batcher and dispatcher (see batcher/config.py for every flag)."""

from __future__ import annotations

import asyncio
import sys

from batcher.config import BatcherSettings
from batcher.service import BatcherService
from llmserve.runtime.log import configure_logging
from llmserve.runtime.server import serve

DESCRIPTION = (
    "Reads the work streams of each model with consumer group 'batchers', forms batches "
    "(max batch, max wait, prefill token budget; strict priority, round-robin across tenants), "
    "and hands each to the live worker with most free KV blocks, atomically. Per-model limits: "
    "--model-overrides '{\"MODEL\": {\"max_batch\": 8, \"max_wait_ms\": 10, \"prefill_token_budget\": 4096}}' "
    "or --model-overrides @FILE.yaml.")


def main(argv: list[str] | None = None) -> int:
    settings = BatcherSettings.load_or_exit(sys.argv[1:] if argv is None else argv, prog="python -m batcher",
                                            description=DESCRIPTION)
    configure_logging("batcher", settings.log_level)

    async def run() -> int:
        stop = asyncio.Event()
        return await serve(BatcherService(settings, stop=stop), settings, "batcher", stop=stop)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
