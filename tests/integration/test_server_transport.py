"""llmserve.runtime.server transport options over real gRPC: reflection on/off, TLS with a certificate
that is rotated on disk (as cert-manager does), and the plaintext health-only port."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmserve.runtime.server import start_server
from llmserve.runtime.settings import CommonSettings


class Idle:
    """A service with no RPCs of its own: the server's own health and reflection are under test."""

    service_names = ("llmserve.v1.Idle",)
    failure = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pass

    async def start(self) -> None:
        pass

    async def drain(self) -> None:
        pass

    async def close(self) -> None:
        pass


def make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


async def health_code(channel: grpc.aio.Channel) -> str:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def listed_services(channel: grpc.aio.Channel) -> list[str] | str:
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
    try:
        # written by hand, not from a request iterator: a server that refuses the method at once can
        # finish the call before an iterator's write, which then reports INTERNAL instead of its status
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        await call.done_writing()
        async for reply in call:
            return sorted(s.name for s in reply.list_services_response.service)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return []


@pytest.mark.parametrize("on", [True, False])
async def test_reflection_follows_its_flag(on):
    handle = await start_server(Idle(), CommonSettings(reflection=on))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            found = await listed_services(channel)
        assert found == (["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                          "llmserve.v1.Idle"] if on else "UNIMPLEMENTED")
    finally:
        await handle.stop(0)


async def test_tls_port_picks_up_a_rotated_certificate_and_health_port_serves_only_health(tmp_path):
    old_cert, old_key = make_cert(tmp_path, "old")
    new_cert, new_key = make_cert(tmp_path, "new")
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(old_cert, live / "tls.crt")
    shutil.copy(old_key, live / "tls.key")
    settings = CommonSettings(tls_cert=str(live / "tls.crt"), tls_key=str(live / "tls.key"), health_port=_free_port())
    handle = await start_server(Idle(), settings)
    await handle.set_serving(True)
    target = f"127.0.0.1:{handle.port}"

    def trusting(cert: Path) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(cert.read_bytes()))

    try:
        async with trusting(old_cert) as channel:
            assert await health_code(channel) == "SERVING"
        async with grpc.aio.insecure_channel(target) as channel:
            assert await health_code(channel) == "UNAVAILABLE"         # no plaintext on the TLS port
        # rotate the way a Secret volume does: both files replaced at once
        for src, dst in ((new_cert, "tls.crt"), (new_key, "tls.key")):
            shutil.copy(src, live / f"{dst}.tmp")
            os.replace(live / f"{dst}.tmp", live / dst)
        async with trusting(new_cert) as channel:
            assert await health_code(channel) == "SERVING"
        async with trusting(old_cert) as channel:
            assert await health_code(channel) == "UNAVAILABLE"
        # the plaintext health port: health and nothing else
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.health_port}") as channel:
            assert await health_code(channel) == "SERVING"
            assert await listed_services(channel) == "UNIMPLEMENTED"
            await handle.set_serving(False)
            assert await health_code(channel) == "NOT_SERVING"
    finally:
        await handle.stop(0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
