"""gRPC llmserve.v1.WorkerAdmin: Drain and Stats."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from gpu_worker.service import WorkerService


class WorkerAdminServicer(worker_pb2_grpc.WorkerAdminServicer):
    def __init__(self, service: WorkerService) -> None:
        self.service = service

    async def Drain(self, request: worker_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.DrainResponse:
        """Start draining (returns at once); the process exits when the drain is done."""
        if request.timeout_s < 0:
            raise InvalidArgument("timeout_s", "must be >= 0")
        self.service.request_drain(request.timeout_s or None)
        return worker_pb2.DrainResponse(draining=True)

    async def Stats(self, request: worker_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStats:
        return self.service.stats()
