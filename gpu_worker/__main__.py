"""`python -m gpu_worker`: one GPU (or CPU) inference worker."""

from __future__ import annotations

import asyncio
import sys

from gpu_worker.config import WorkerSettings
from gpu_worker.service import WorkerService
from llmserve.log import configure_logging
from llmserve.server import serve
from llmserve.valkey import free_port

DESCRIPTION = ("Inference worker: consumes its Redis inbox, runs continuous batching over a paged KV cache, "
               "publishes token events, heartbeats its capacity; SIGTERM drains and hands work back.")


def main(argv: list[str] | None = None) -> int:
    settings = WorkerSettings.load_or_exit(sys.argv[1:] if argv is None else argv,
                                           prog="python -m gpu_worker", description=DESCRIPTION)
    configure_logging("gpu_worker", settings.log_level)
    if settings.port == 0:
        settings.port = free_port()     # the heartbeat advertises the admin address, so fix it now

    async def run() -> None:
        stop = asyncio.Event()
        await serve(WorkerService(settings, stop), settings, "gpu_worker", stop=stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
