"""`python -m gateway`: the public Inference service."""

from __future__ import annotations

import asyncio
import sys

from llmserve.log import configure_logging
from llmserve.server import serve
from llmserve.settings import SettingsError

from gateway.config import GatewaySettings
from gateway.service import InferenceService


def main(argv: list[str] | None = None) -> int:
    try:
        settings = GatewaySettings.load(sys.argv[1:] if argv is None else argv, prog="python -m gateway",
                                        description="llmserve gateway: auth, quotas, admission, streaming")
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    configure_logging("gateway", settings.log_level)
    asyncio.run(serve(InferenceService(settings), settings, "gateway",
                      max_message_bytes=settings.max_message_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
