"""`python -m gateway`: the public Inference service."""

from __future__ import annotations

import asyncio
import sys

from gateway.config import GatewaySettings
from gateway.service import InferenceService
from llmserve.log import configure_logging
from llmserve.server import serve


def main(argv: list[str] | None = None) -> int:
    settings = GatewaySettings.load_or_exit(sys.argv[1:] if argv is None else argv, prog="python -m gateway",
                                            description="llmserve gateway: auth, quotas, admission, streaming")
    configure_logging("gateway", settings.log_level)
    return asyncio.run(_run(settings))


async def _run(settings: GatewaySettings) -> int:
    # Built inside the loop: grpc.aio channels bind to the loop that exists when they are made.
    service = InferenceService(settings)
    return await serve(service, settings, "gateway", max_message_bytes=settings.max_message_bytes)


if __name__ == "__main__":
    sys.exit(main())
