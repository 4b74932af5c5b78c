"""uvicorn serving the OpenAI app in the gateway's own event loop, HTTPS with the gRPC port's
certificate when one is set, reloaded the way gRPC reloads it (`llmserve.runtime.server.CertificateFiles`):

    handshake ─▶ SNI callback (called for every ClientHello, SNI or not)
              ─▶ files changed since the last load? load a fresh context
              ─▶ this connection, and every later one, continues on the newest context

Connections already open keep the certificate they got.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import structlog
import uvicorn
from starlette.applications import Starlette

from llmserve.runtime.server import CertificateFiles, write_port_file

logger = structlog.get_logger(__name__)


class ReloadingTLS:
    """The listening socket's SSL context; its SNI callback moves each handshake onto the newest
    certificate."""

    def __init__(self, cert_path: str, key_path: str) -> None:
        self.files = CertificateFiles(cert_path, key_path)
        self.context = self._load()
        self.current = self.context
        self.context.sni_callback = self._on_hello

    def _load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.files.cert_path, self.files.key_path)
        return context

    def _on_hello(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        fresh = self.files.reload_if_changed(self._load)
        if fresh is not None:
            self.current = fresh
        if self.current is not context:
            connection.context = self.current


class HttpServer:
    """uvicorn serving `app` on a socket bound here (port 0 / -1: the kernel picks one), its port
    written to `port_file` once it listens.

    uvicorn's own `serve()` would install its signal handlers over the gateway's; this runs its
    startup / main loop / shutdown steps instead, and stops when told.
    """

    def __init__(self, app: Starlette, host: str, port: int, tls_cert: str = "", tls_key: str = "",
                 port_file: str = "") -> None:
        self.port_file = port_file
        self.socket = socket.create_server((host, max(0, port)), reuse_port=False)
        self.port = self.socket.getsockname()[1]
        self.tls = ReloadingTLS(tls_cert, tls_key) if tls_cert else None
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        config = self.server.config
        config.load()
        config.ssl = self.tls.context if self.tls is not None else None
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup(sockets=[self.socket])
        self._task = asyncio.create_task(self.server.main_loop(), name="http")
        if self.port_file:      # reported once listening, as the gRPC port is
            write_port_file(self.port_file, self.port)
        logger.info("openai http serving", port=self.port, tls=self.tls is not None)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        await self._task
        await self.server.shutdown(sockets=[self.socket])
        self._task = None
