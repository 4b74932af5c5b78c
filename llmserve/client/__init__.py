"""Python client of the llmserve gateway (`llmserve.v1.Inference`), sync and asyncio.

    client = Client("127.0.0.1:50051", api_key="dev-key")
    for chunk in client.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=32):
        print(chunk.text, end="")
    print(chunk.finish_reason, chunk.usage)

Every call takes `timeout` (seconds; the deadline travels to the worker); generate and
complete default to DEFAULT_TIMEOUT_S, so a caller never hangs for ever (None = no deadline).
UNAVAILABLE is retried with exponential backoff and full jitter until the
deadline. A stream that breaks part-way (gateway restart, network) is resumed
by request_id from the next index (`x-resume-from`), so the caller sees every
index exactly once and the request is generated and charged once. Closing a
`generate` iterator early cancels the request.

Tools, n and logprobs (docs/tools.md, docs/logprobs.md):

    reply = client.complete(messages=[...], tools=[WEATHER], tool_choice="required", n=2, logprobs=True)
    reply.tool_calls[0].name, reply.tool_calls[0].parsed_arguments()    # choice 0; all in reply.choices
    messages += [reply.as_message(), {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "18 C"}]

Streamed, each chunk names its `choice_index` and carries the tool calls that completed in it;
a resumed stream keeps each choice's index and each call exactly once.
Requests are built by llmserve/client/request.py, replies read by llmserve/client/results.py.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import cast

import grpc

from llmserve.client.request import build_request, messages_of
from llmserve.client.results import Choice, Chunk, Completion, TokenLogprob, ToolCall, TopLogprob, Usage, to_chunk, to_completion
from llmserve.runtime.retry import is_retryable, remaining
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import inference_pb2_grpc

__all__ = ["DEFAULT_TIMEOUT_S", "AsyncClient", "Chunk", "Choice", "Client", "Completion", "LLMServeError", "Model",
           "ResumeCursor", "RetryPolicy", "StreamEnded", "TokenLogprob", "ToolCall", "TopLogprob", "Usage",
           "build_request", "to_chunk"]

DEFAULT_TIMEOUT_S = 300.0   # generate/complete deadline unless the caller gives one

@dataclass(frozen=True)
class Model:
    id: str
    context_length: int


class LLMServeError(Exception):
    """A call failed: `code` (grpc.StatusCode), `details`, `retry_after_ms` (RESOURCE_EXHAUSTED), `request_id`."""

    def __init__(self, code: grpc.StatusCode, details: str, request_id: str = "", retry_after_ms: int | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.request_id = request_id
        self.retry_after_ms = retry_after_ms


@dataclass
class RetryPolicy:
    """Exponential backoff with full jitter: sleep before retry n is uniform in [0, min(max_s, initial_s * 2**n)]."""

    max_attempts: int = 10
    initial_s: float = 0.1
    max_backoff_s: float = 2.0
    rng: random.Random = field(default_factory=random.Random)

    def backoff(self, attempt: int) -> float:
        return self.rng.uniform(0.0, min(self.max_backoff_s, self.initial_s * 2 ** attempt))

    def should_retry(self, exc: BaseException, attempt: int, deadline: float | None) -> float | None:
        """Seconds to sleep before the next attempt, or None to give up."""
        if not (isinstance(exc, StreamEnded) or is_retryable(exc)) or attempt + 1 >= self.max_attempts:
            return None
        sleep = self.backoff(attempt)
        if deadline is not None and time.monotonic() + sleep >= deadline:
            return None
        return sleep


def _error(exc: BaseException, request_id: str = "") -> LLMServeError:
    if isinstance(exc, StreamEnded):
        return LLMServeError(grpc.StatusCode.UNAVAILABLE, "stream ended without a final chunk", request_id)
    trailing = dict(exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else {}
    initial = dict(exc.initial_metadata() or ()) if hasattr(exc, "initial_metadata") else {}
    retry = trailing.get("retry-after-ms")
    rpc = cast(grpc.RpcError, exc)   # every other exception reaching here is a gRPC error
    return LLMServeError(rpc.code(), rpc.details() or "", initial.get("x-request-id", request_id),
                         int(retry) if retry and str(retry).isdigit() else None)


class ResumeCursor:
    """Exactly-once delivery across resumed streams: drops chunks whose index was already delivered.

    With n choices each has its own index: a resume asks for the chunks from the lowest index a
    still open choice needs, and the repeats of the others are dropped here.
    """

    def __init__(self, n: int = 1) -> None:
        self.positions = [0] * n       # next index per choice
        self.ended = [False] * n
        self.started = False

    @property
    def finished(self) -> bool:
        return all(self.ended)

    @property
    def next_index(self) -> int:
        """Where a resume starts: the lowest next index of the open choices."""
        return min((p for p, e in zip(self.positions, self.ended) if not e), default=max(self.positions))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-resume-from", str(self.next_index)),) if self.started else ()

    def accept(self, resp: pb.GenerateResponse) -> bool:
        """True when `resp` is new and should go to the caller.

        The gateway cuts a request's chunks at the same places on every attach,
        so a chunk either starts at or after its choice's next index (new) or
        repeats one already delivered.
        """
        self.started = True
        choice = resp.choice_index
        if choice >= len(self.positions):
            return False                 # not a choice of this request
        final = resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        if self.ended[choice] or (resp.index < self.positions[choice] and not final):
            return False
        self.positions[choice] = max(self.positions[choice], resp.index + len(resp.token_ids))
        self.ended[choice] = final
        return True


class StreamEnded(Exception):
    """The server closed a stream without its final chunk; retried like UNAVAILABLE."""


def _credentials(tls: bool, root_cert: str | bytes | None) -> grpc.ChannelCredentials | None:
    if not tls and not root_cert:
        return None
    if isinstance(root_cert, str):
        with open(root_cert, "rb") as f:
            root_cert = f.read()
    return grpc.ssl_channel_credentials(root_certificates=root_cert)


_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 * 1024 * 1024),
                    ("grpc.max_send_message_length", 16 * 1024 * 1024)]


class Client:
    """Blocking client.

    Args:
        target: gateway HOST:PORT.
        api_key: sent as `authorization: Bearer <api_key>`.
        tls: use TLS (system roots unless root_cert is given).
        root_cert: PEM bytes or a file path of the CA to trust.
        retry: backoff policy for UNAVAILABLE.
    """

    def __init__(self, target: str, api_key: str = "", tls: bool = False, root_cert: str | bytes | None = None,
                 retry: RetryPolicy | None = None) -> None:
        creds = _credentials(tls, root_cert)
        self.channel = (grpc.secure_channel(target, creds, _CHANNEL_OPTIONS) if creds
                        else grpc.insecure_channel(target, _CHANNEL_OPTIONS))
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.retry = retry or RetryPolicy()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, method, request, timeout: float | None, request_id: str = "", metadata=()):
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            try:
                return method.with_call(request, metadata=self.auth + tuple(metadata), timeout=remaining(deadline))
            except grpc.RpcError as exc:
                sleep = self.retry.should_retry(exc, attempt, deadline)
                if sleep is None:
                    raise _error(exc, request_id) from None
                time.sleep(sleep)
                attempt += 1

    def generate(self, prompt: str | None = None, messages=None, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 **params) -> Iterator[Chunk]:
        """Stream a completion; `params` as in `build_request` (max_new_tokens, temperature, seed, request_id...)."""
        request = build_request(prompt, messages, **params)
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor, attempt, call = ResumeCursor(request.n or 1), 0, None
        try:
            while not cursor.finished:
                try:
                    call = self.stub.Generate(request, metadata=self.auth + cursor.metadata(),
                                              timeout=remaining(deadline))
                    for resp in call:
                        if cursor.accept(resp):
                            yield to_chunk(resp)
                    if not cursor.finished:
                        raise StreamEnded()
                except (grpc.RpcError, StreamEnded) as exc:
                    sleep = self.retry.should_retry(exc, attempt, deadline)
                    if sleep is None:
                        raise _error(exc, request.request_id) from None
                    time.sleep(sleep)
                    attempt += 1
        finally:
            if cursor.started and not cursor.finished:
                self._abandon(call, request.request_id)

    def _abandon(self, call, request_id: str) -> None:
        """The caller stopped reading: cancel the call and the request (best effort)."""
        if call is not None:
            call.cancel()
        try:
            self.stub.Cancel(pb.CancelRequest(request_id=request_id), metadata=self.auth, timeout=2.0)
        except grpc.RpcError:
            pass

    def complete(self, prompt: str | None = None, messages=None, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 **params) -> Completion:
        """The whole completion at once (retries re-attach to the same request_id)."""
        request = build_request(prompt, messages, **params)
        reply, _ = self._unary(self.stub.Complete, request, timeout, request.request_id)
        return to_completion(reply)

    def cancel(self, request_id: str, timeout: float | None = 10.0) -> None:
        self._unary(self.stub.Cancel, pb.CancelRequest(request_id=request_id), timeout, request_id)

    def tokenize(self, text: str | None = None, messages=None, *, model: str = "",
                 timeout: float | None = 30.0) -> list[int]:
        request = pb.TokenizeRequest(model=model, text=text or "", messages=messages_of(messages))
        reply, _ = self._unary(self.stub.Tokenize, request, timeout)
        return list(reply.token_ids)

    def list_models(self, timeout: float | None = 10.0) -> list[Model]:
        reply, _ = self._unary(self.stub.ListModels, pb.ListModelsRequest(), timeout)
        return [Model(m.id, m.context_length) for m in reply.models]


class AsyncClient:
    """The asyncio twin of `Client` (same arguments, awaitable calls, `generate` is an async iterator)."""

    def __init__(self, target: str, api_key: str = "", tls: bool = False, root_cert: str | bytes | None = None,
                 retry: RetryPolicy | None = None) -> None:
        creds = _credentials(tls, root_cert)
        self.channel = (grpc.aio.secure_channel(target, creds, _CHANNEL_OPTIONS) if creds
                        else grpc.aio.insecure_channel(target, _CHANNEL_OPTIONS))
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.retry = retry or RetryPolicy()

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, method, request, timeout: float | None, request_id: str = ""):
        import asyncio
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            try:
                return await method(request, metadata=self.auth, timeout=remaining(deadline))
            except grpc.RpcError as exc:
                sleep = self.retry.should_retry(exc, attempt, deadline)
                if sleep is None:
                    raise _error(exc, request_id) from None
                await asyncio.sleep(sleep)
                attempt += 1

    async def generate(self, prompt: str | None = None, messages=None, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                       **params) -> AsyncIterator[Chunk]:
        import asyncio
        request = build_request(prompt, messages, **params)
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor, attempt, call = ResumeCursor(request.n or 1), 0, None
        try:
            while not cursor.finished:
                try:
                    call = self.stub.Generate(request, metadata=self.auth + cursor.metadata(),
                                              timeout=remaining(deadline))
                    async for resp in call:
                        if cursor.accept(resp):
                            yield to_chunk(resp)
                    if not cursor.finished:
                        raise StreamEnded()
                except (grpc.RpcError, StreamEnded) as exc:
                    sleep = self.retry.should_retry(exc, attempt, deadline)
                    if sleep is None:
                        raise _error(exc, request.request_id) from None
                    await asyncio.sleep(sleep)
                    attempt += 1
        finally:
            if cursor.started and not cursor.finished:
                if call is not None:
                    call.cancel()
                try:
                    await self.stub.Cancel(pb.CancelRequest(request_id=request.request_id), metadata=self.auth,
                                           timeout=2.0)
                except grpc.RpcError:
                    pass

    async def complete(self, prompt: str | None = None, messages=None, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                       **params) -> Completion:
        request = build_request(prompt, messages, **params)
        reply = await self._unary(self.stub.Complete, request, timeout, request.request_id)
        return to_completion(reply)

    async def cancel(self, request_id: str, timeout: float | None = 10.0) -> None:
        await self._unary(self.stub.Cancel, pb.CancelRequest(request_id=request_id), timeout, request_id)

    async def tokenize(self, text: str | None = None, messages=None, *, model: str = "",
                       timeout: float | None = 30.0) -> list[int]:
        request = pb.TokenizeRequest(model=model, text=text or "", messages=messages_of(messages))
        return list((await self._unary(self.stub.Tokenize, request, timeout)).token_ids)

    async def list_models(self, timeout: float | None = 10.0) -> list[Model]:
        reply = await self._unary(self.stub.ListModels, pb.ListModelsRequest(), timeout)
        return [Model(m.id, m.context_length) for m in reply.models]
