#!/opt/venv/bin/python
"""Container health probe over grpc.health.v1: exit 0 iff the server answers SERVING.

    grpc-health-check [HOST:PORT] [--service NAME] [--timeout SECONDS]

The target defaults to 127.0.0.1:$LLMSERVE_PORT, the port the service in the same
container listens on, so one HEALTHCHECK line serves every service. Used by the
image's HEALTHCHECK and docker-compose.yml; Kubernetes uses its native gRPC probe.
(grpc_health_probe is not on PyPI, so this is the few lines it would take.)
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def default_target() -> str:
    port = os.environ.get("LLMSERVE_PORT", "")
    return f"127.0.0.1:{port}" if port and port != "0" else ""


def check(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(SERVING?, what the server said or why it could not be asked)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpc-health-check", description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", default=default_target(), help="HOST:PORT (default 127.0.0.1:$LLMSERVE_PORT)")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    if not args.target:
        print("grpc-health-check: no target and LLMSERVE_PORT is unset", file=sys.stderr)
        return 2
    serving, said = check(args.target, args.service, args.timeout)
    print(f"{args.target}: {said}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
