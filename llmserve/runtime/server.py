"""gRPC server bootstrap shared by every service.

`serve()` runs one `Service` behind a grpc.aio server with the health service,
reflection (unless `--reflection false`), the exception interceptor and Prometheus
metrics, and stops it gracefully:

    SIGTERM/SIGINT ─▶ health NOT_SERVING ─▶ service.drain() ─▶ server.stop(grace)
                   ─▶ service.close() ─▶ exit 0

A service whose background work died (`service.failure` set, then the stop event)
skips the drain: health NOT_SERVING ─▶ server.stop(0) ─▶ service.close() ─▶ exit 1,
so its supervisor (`llmserve up`, compose, Kubernetes) starts a fresh one.

With `--tls-cert/--tls-key` the port speaks TLS only; a renewed certificate (cert-manager
rewriting its Secret) is picked up at the next handshake. `--health-port` adds a plaintext
port that serves grpc.health.v1 and nothing else, for probes that cannot speak TLS.

The port is bound before anything else (port 0 = the kernel picks one) and, with
`--port-file`, written there for the supervisor: no port is ever picked before binding.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
import prometheus_client
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmserve.runtime import redis_client, tracing
from llmserve.runtime.errors import ServiceError, Unavailable
from llmserve.runtime.settings import CommonSettings
from llmserve.runtime.tasks import cancel_and_wait

logger = structlog.get_logger(__name__)
FAILED_CLOSE_S = 10.0   # how long a failed service may take to close before it exits regardless
T = TypeVar("T")

# Downstream gRPC codes that keep their meaning when passed on to our caller.
_PASS_THROUGH_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED,
})


class Service(Protocol):
    """What `serve()` needs from a service."""

    @property
    def service_names(self) -> Sequence[str]: ...  # full names, e.g. "llmserve.v1.Inference"

    def add_to_server(self, server: grpc.aio.Server) -> None: ...
    async def start(self) -> None: ...   # background work; called before SERVING
    async def drain(self) -> None: ...   # stop taking new work; in-flight calls go on
    async def close(self) -> None: ...   # release resources after the server stopped
    # set (then the stop event) when background work died: serve() exits 1 without draining
    @property
    def failure(self) -> BaseException | None: ...


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    """The status a caller gets for an exception that escaped a handler."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message, exc.trailing_metadata()
    if isinstance(exc, redis_client.UNAVAILABLE_ERRORS):
        return grpc.StatusCode.UNAVAILABLE, "redis unavailable", ()
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code() if exc.code() in _PASS_THROUGH_CODES else grpc.StatusCode.UNAVAILABLE
        return code, f"dependency failed: {exc.details()}", ()
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", ()
    return grpc.StatusCode.INTERNAL, "internal error", ()


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message, trailing = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("unhandled error", error=repr(exc))
    else:
        logger.info("request failed", code=code.name, reason=message)
    if trailing:
        context.set_trailing_metadata(trailing)
    await context.abort(code, message)


class ExceptionInterceptor(grpc.aio.ServerInterceptor):
    """The one choke point that maps exceptions to exact status codes.

    Until the service has started (models loaded, dependencies reached) its own RPCs answer
    UNAVAILABLE, which callers retry; health and reflection answer from the first moment.
    """

    def __init__(self, gated_services: Sequence[str]) -> None:
        self.gated_prefixes = tuple(f"/{name}/" for name in gated_services)
        self.started = False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if not self.started and handler_call_details.method.startswith(self.gated_prefixes):
            handler = _not_started(handler)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return handler


def _not_started(handler):
    async def unary(request, context):
        raise Unavailable("starting")

    async def stream(request, context):
        raise Unavailable("starting")
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


def _wrap_unary(behavior):
    async def wrapper(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the choke point
            await _abort(context, exc)
    return wrapper


def _wrap_stream(behavior):
    if not inspect.isasyncgenfunction(behavior):
        return _wrap_unary(behavior)    # it writes with context.write() (grpc health's Watch): awaited once

    async def wrapper(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the choke point
            await _abort(context, exc)
    return wrapper


def _bind(server: grpc.aio.Server, settings: CommonSettings) -> int:
    address = f"{settings.host}:{settings.port}"
    if settings.tls_cert:
        return server.add_secure_port(address, tls_credentials(settings.tls_cert, settings.tls_key))
    return server.add_insecure_port(address)


def _file_stamp(*paths: str) -> tuple:
    return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in map(os.stat, paths))


class CertificateFiles:
    """A PEM certificate and key on disk, re-read at the first handshake after either file changed
    (a Secret volume swaps both at once). One mechanism for every TLS listener (gRPC, HTTP)."""

    def __init__(self, cert_path: str, key_path: str) -> None:
        self.cert_path, self.key_path = cert_path, key_path
        self._stamp = _file_stamp(cert_path, key_path)

    def reload_if_changed(self, load: Callable[[], T]) -> T | None:
        """`load()` when the files changed since the last load, else None. Mid-rotation (a file
        missing or unreadable) the current certificate stays and the next handshake tries again."""
        try:
            stamp = _file_stamp(self.cert_path, self.key_path)
            if stamp == self._stamp:
                return None
            fresh = load()
        except (OSError, ssl.SSLError) as exc:
            logger.warning("tls certificate not reloaded", error=repr(exc))
            return None
        self._stamp = stamp
        logger.info("tls certificate reloaded", cert=self.cert_path)
        return fresh


def tls_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    """Server TLS from PEM files, reloaded as `CertificateFiles` says; connections already open keep
    the certificate they got."""
    def configuration() -> grpc.ServerCertificateConfiguration:
        key, cert = Path(key_path).read_bytes(), Path(cert_path).read_bytes()
        return grpc.ssl_server_certificate_configuration([(key, cert)])

    files = CertificateFiles(cert_path, key_path)
    return grpc.dynamic_ssl_server_credentials(configuration(), lambda: files.reload_if_changed(configuration))


async def _start_health_server(health_servicer: health.aio.HealthServicer,
                               settings: CommonSettings) -> tuple[grpc.aio.Server | None, int]:
    """The plaintext health-only server on settings.health_port (None when it is 0)."""
    if not settings.health_port:
        return None, 0
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{settings.host}:{settings.health_port}")
    await server.start()
    return server, port


class ServerHandle:
    """A started server and its health state."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 names: Sequence[str], port: int, interceptor: ExceptionInterceptor,
                 health_server: grpc.aio.Server | None = None, health_port: int = 0) -> None:
        self.server = server
        self.health = health_servicer
        self.names = names
        self.port = port
        self.interceptor = interceptor
        self.health_server = health_server
        self.health_port = health_port

    async def stop(self, grace_s: float | None) -> None:
        """Stop the server (in-flight calls get `grace_s`); the health port answers until then."""
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING / NOT_SERVING; the first SERVING also opens the service's own RPCs."""
        self.interceptor.started |= serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.names):
            await self.health.set(name, status)


async def start_server(service: Service, settings: CommonSettings,
                       max_message_bytes: int = 4 * 1024 * 1024) -> ServerHandle:
    """Create, bind and start the server; health stays NOT_SERVING until set."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    interceptor = ExceptionInterceptor(service.service_names)
    server = grpc.aio.server(interceptors=[interceptor], options=options)
    service.add_to_server(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service.service_names)
    if settings.reflection:
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = _bind(server, settings)
    await server.start()
    health_server, health_port = await _start_health_server(health_servicer, settings)
    handle = ServerHandle(server, health_servicer, names, port, interceptor, health_server, health_port)
    await handle.set_serving(False)
    return handle


def _install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def write_port_file(path: str, port: int) -> None:
    """Atomically write the bound port (a reader never sees a half-written file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(f"{port}\n")
    os.replace(tmp, path)


async def serve(service: Service, settings: CommonSettings, name: str,
                max_message_bytes: int = 4 * 1024 * 1024, stop: asyncio.Event | None = None) -> int:
    """Run `service` until SIGTERM/SIGINT (or `stop`), then stop gracefully.

    Returns:
        the process exit code: 0 after a graceful stop, 1 when the service's background work died.
    """
    stop = stop or asyncio.Event()
    _install_stop_signals(stop)
    tracing.configure(name)   # off unless OTEL_TRACES_EXPORTER says otherwise
    if settings.metrics_port:
        metrics, _ = prometheus_client.start_http_server(max(settings.metrics_port, 0), addr=settings.host)
        settings.metrics_port = metrics.server_port
        if settings.metrics_port_file:
            write_port_file(settings.metrics_port_file, metrics.server_port)
    handle = await start_server(service, settings, max_message_bytes)
    settings.port = handle.port          # from here on the settings name the port actually bound
    if settings.port_file:
        write_port_file(settings.port_file, handle.port)
    if not await _start_unless_stopped(service, stop):
        logger.info("stopped while starting")
        await handle.stop(0)
        await service.close()
        tracing.shutdown()
        return 0
    if not stop.is_set():
        await handle.set_serving(True)
        logger.info("serving", address=f"{settings.host}:{handle.port}", metrics_port=settings.metrics_port,
                    tls=bool(settings.tls_cert), reflection=settings.reflection, health_port=handle.health_port)
    await stop.wait()
    if getattr(service, "failure", None) is not None:
        return await _stop_failed(service, handle)
    logger.info("stopping", grace_s=settings.grace_s)
    await handle.set_serving(False)
    await service.drain()
    await handle.stop(settings.grace_s)
    await service.close()
    tracing.shutdown()
    logger.info("stopped")
    return 0


async def _start_unless_stopped(service: Service, stop: asyncio.Event) -> bool:
    """`service.start()`, abandoned when `stop` is set first (SIGTERM while it waits for Redis or
    loads a model): False then. A start that raises still raises."""
    starting = asyncio.ensure_future(service.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if starting.done():
        starting.result()
        return True
    await cancel_and_wait(starting)
    return False


async def _stop_failed(service: Service, handle: ServerHandle) -> int:
    logger.error("service failed; exiting for the supervisor to restart it", error=repr(service.failure))
    await handle.set_serving(False)
    try:   # a failed service must exit: its supervisor restarts it, a hung close would keep it from that
        async with asyncio.timeout(FAILED_CLOSE_S):
            await _close_after_failure(service, handle)
    except TimeoutError:
        logger.error("closing after the failure hung; exiting anyway", timeout_s=FAILED_CLOSE_S)
    tracing.shutdown()
    return 1


async def _close_after_failure(service: Service, handle: ServerHandle) -> None:
    await handle.stop(0)
    await service.close()
