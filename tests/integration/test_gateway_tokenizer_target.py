"""A gateway whose tokenizer address answers with some other gRPC server (a port taken over,
a wrong address) says so and keeps retrying; once the real tokenizer_svc serves there, it
becomes SERVING."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from llmserve.local.stack import ServiceProcess
from tests.conftest import TEST_TENANTS

MODEL = "smollm2-135m"


def foreign_server() -> tuple[grpc.Server, int]:
    """A gRPC server with only the health service: it answers UNIMPLEMENTED to Tokenizer calls."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_gateway_retries_a_foreign_tokenizer_target_until_the_real_one_serves(redis_url, smollm2_path, tmp_path):
    server, port = foreign_server()
    common = ["--host", "127.0.0.1", "--redis-url", redis_url, "--models", MODEL]
    gateway = ServiceProcess("gateway", "gateway", [*common, "--tenants", str(TEST_TENANTS),
                                                    "--tokenizer-target", f"127.0.0.1:{port}"],
                             0, tmp_path / "gateway.log", None).start()
    tokenizer = ServiceProcess("tokenizer_svc", "tokenizer_svc", [*common, "--workers", "1"], port,
                               tmp_path / "tokenizer.log", None)
    try:
        deadline = time.monotonic() + 120
        while "is not a tokenizer service" not in gateway.log_path.read_text(errors="replace"):
            assert gateway.alive(), gateway.log_tail()
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
        server.stop(0).wait()
        tokenizer.start().wait_serving(time.monotonic() + 180)
        gateway.wait_serving(time.monotonic() + 180)
    finally:
        server.stop(0)
        assert gateway.stop(30) == 0, gateway.log_tail()
        tokenizer.stop(30)
