"""Drive the public gRPC API: closed loop (N clients back to back) or open loop (Poisson arrivals).

Each request is one streaming `Generate`; the runner timestamps every message
that carries tokens, so TTFT and inter-token latency are measured at the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from llmserve.loadgen.stats import RequestResult
from llmserve.loadgen.workload import RequestSpec
from llmserve.protocol.slo import Targets
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RunSettings:
    """How each request is sent."""

    target: str
    model: str = ""
    temperature: float = 1.0
    timeout_s: float = 300.0
    chat: bool = False                  # send the prompt as one user chat message
    tls: bool = False
    root_cert: bytes | None = None
    slo: Targets = Targets()            # latency targets sent with every request (0 = none)


def open_channel(settings: RunSettings) -> grpc.aio.Channel:
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if settings.tls:
        credentials = grpc.ssl_channel_credentials(root_certificates=settings.root_cert)
        return grpc.aio.secure_channel(settings.target, credentials, options=options)
    return grpc.aio.insecure_channel(settings.target, options=options)


def build_request(spec: RequestSpec, settings: RunSettings) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=settings.temperature, max_new_tokens=spec.max_new_tokens,
                                 seed=spec.seed)
    request = pb.GenerateRequest(model=settings.model, sampling=sampling)
    if settings.slo.any:
        request.slo_ttft_ms, request.slo_tpot_ms = settings.slo.ttft_ms, settings.slo.tpot_ms
    if settings.chat:
        request.messages.append(pb.ChatMessage(role="user", content=spec.prompt))
    else:
        request.prompt = spec.prompt
    return request


async def run_one(stub: inference_pb2_grpc.InferenceStub, spec: RequestSpec, settings: RunSettings) -> RequestResult:
    """Send one streaming Generate and record when each token-bearing message arrived."""
    start = time.monotonic()
    result = RequestResult(tenant=spec.tenant, code="OK", start_s=start, end_s=start)
    metadata = (("authorization", f"Bearer {spec.api_key}"),)
    try:
        call = stub.Generate(build_request(spec, settings), metadata=metadata, timeout=settings.timeout_s)
        async for message in call:
            _record(result, message)
    except grpc.aio.AioRpcError as exc:
        result.code, result.message = exc.code().name, exc.details() or ""
    result.end_s = time.monotonic()
    return result


def _record(result: RequestResult, message: pb.GenerateResponse) -> None:
    now = time.monotonic()
    if message.token_ids:
        if result.first_token_s is None:
            result.first_token_s = now
        result.chunk_times_s.append(now)
        result.chunk_tokens.append(len(message.token_ids))
    if message.HasField("usage") and message.usage.prompt_tokens:
        result.prompt_tokens = message.usage.prompt_tokens


Progress = Callable[[RequestResult], None]


async def run_closed(specs: Sequence[RequestSpec], concurrency: int, settings: RunSettings,
                     progress: Progress = lambda r: None) -> tuple[list[RequestResult], float]:
    """`concurrency` clients, each sending its next request as soon as the previous one ends.

    Returns the results in workload order and the wall time of the run.
    """
    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    results: dict[int, RequestResult] = {}

    async def client(stub: inference_pb2_grpc.InferenceStub) -> None:
        while not queue.empty():
            spec = queue.get_nowait()
            results[spec.seq] = await run_one(stub, spec, settings)
            progress(results[spec.seq])

    async with open_channel(settings) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start = time.monotonic()
        await asyncio.gather(*(client(stub) for _ in range(max(1, concurrency))))
        wall = time.monotonic() - start
    return [results[s.seq] for s in specs], wall


async def run_open(specs: Sequence[RequestSpec], arrivals_s: Sequence[float], settings: RunSettings,
                   progress: Progress = lambda r: None) -> tuple[list[RequestResult], float]:
    """Send spec i at arrivals_s[i] seconds after the start, whether or not earlier ones finished."""
    if len(arrivals_s) != len(specs):
        raise ValueError("one arrival time per request")

    async with open_channel(settings) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start = time.monotonic()

        async def fire(spec: RequestSpec, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            result = await run_one(stub, spec, settings)
            progress(result)
            return result

        results = await asyncio.gather(*(fire(s, t) for s, t in zip(specs, arrivals_s)))
        wall = time.monotonic() - start
    return list(results), wall
