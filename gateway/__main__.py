"""`python -m gateway`: the public Inference service, over gRPC and (with --http-port) OpenAI HTTP."""

from __future__ import annotations

import asyncio
import sys

from gateway.config import GatewaySettings
from gateway.core import Gateway
from gateway.grpc_front import InferenceService
from gateway.http_server import HttpServer
from gateway.openai_http import OpenAIHttp
from llmserve.runtime.log import configure_logging
from llmserve.runtime.server import serve


def main(argv: list[str] | None = None) -> int:
    settings = GatewaySettings.load_or_exit(sys.argv[1:] if argv is None else argv, prog="python -m gateway",
                                            description="llmserve gateway: auth, quotas, admission, streaming")
    configure_logging("gateway", settings.log_level)
    return asyncio.run(_run(settings))


def build(settings: GatewaySettings, stop: asyncio.Event | None = None) -> InferenceService:
    """One `Gateway`, and the fronts over it: gRPC, and the OpenAI HTTP endpoint when it is on."""
    gateway = Gateway(settings, stop)
    http = None
    if settings.http_port:
        app = OpenAIHttp(gateway, settings.max_http_body_bytes, settings.http_request_timeout_s).app
        http = HttpServer(app, settings.host, settings.http_port, settings.tls_cert, settings.tls_key,
                          settings.http_port_file)
    return InferenceService(gateway, http)


async def _run(settings: GatewaySettings) -> int:
    # Built inside the loop: grpc.aio channels bind to the loop that exists when they are made.
    stop = asyncio.Event()
    return await serve(build(settings, stop), settings, "gateway", max_message_bytes=settings.max_message_bytes,
                       stop=stop)


if __name__ == "__main__":
    sys.exit(main())
