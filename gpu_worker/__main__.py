"""`python -m gpu_worker`: one GPU (or CPU) inference worker."""

from __future__ import annotations

import asyncio
import sys

from gpu_worker.config import WorkerSettings
from gpu_worker.model.architectures import UnsupportedModel
from gpu_worker.model.loader import check_supported
from gpu_worker.service import WorkerService
from llmserve.catalog import model_store
from llmserve.runtime.log import bind_model, configure_logging
from llmserve.runtime.server import serve

DESCRIPTION = ("Inference worker: consumes its Redis inbox, runs continuous batching over a paged KV cache, "
               "publishes token events, heartbeats its capacity; SIGTERM drains and hands work back.")


def main(argv: list[str] | None = None) -> int:
    settings = WorkerSettings.load_or_exit(sys.argv[1:] if argv is None else argv,
                                           prog="python -m gpu_worker", description=DESCRIPTION)
    configure_logging("gpu_worker", settings.log_level)
    try:
        check_supported(settings.model, load_follows=True)  # the service's load takes its GGUF reader
    except (UnsupportedModel, FileNotFoundError) as exc:  # the one line an operator needs, not a traceback
        sys.stderr.write(f"python -m gpu_worker: {exc}\n")
        return 2
    bind_model(model_store.model_id(settings.model))  # the concrete id, on every line of this worker

    async def run() -> int:
        stop = asyncio.Event()
        return await serve(WorkerService(settings, stop), settings, "gpu_worker", stop=stop)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
