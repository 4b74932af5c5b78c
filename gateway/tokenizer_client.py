"""What the gateway knows about each concrete model, fetched from tokenizer_svc at start-up:
the tokenizer (for local incremental detokenization), EOS ids and context length.
Encode calls go to tokenizer_svc with a deadline and jittered retries.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import structlog
from tokenizers import Tokenizer

from llmserve.runtime import tracing
from llmserve.runtime.errors import NotFound, Unavailable
from llmserve.runtime.retry import remaining, retrying
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc

logger = structlog.get_logger(__name__)

ReplyT = TypeVar("ReplyT")


@dataclass(frozen=True)
class ModelInfo:
    id: str
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    context_length: int


class TokenizerClient:
    """Model id → ModelInfo (fetched from tokenizer_svc at start-up), and Encode calls to it."""

    def __init__(self, ids: list[str], tokenizer_target: str, timeout_s: float = 5.0) -> None:
        self.ids = list(ids)
        self.timeout_s = timeout_s
        self.target = tokenizer_target
        # round_robin: a headless Service's DNS name resolves to every tokenizer pod; the default
        # pick_first would send every call to one of them
        self.channel = grpc.aio.insecure_channel(tokenizer_target, options=[
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.max_receive_message_length", 64 * 2**20),  # tokenizer JSON of large vocabularies
        ])
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)
        self.models: dict[str, ModelInfo] = {}

    async def load(self, wait_s: float) -> None:
        """GetTokenizerInfo for every model, retrying until tokenizer_svc answers or wait_s passes."""
        deadline = time.monotonic() + wait_s
        for model_id in self.ids:
            async for attempt in retrying(deadline=deadline, max_attempts=10_000, max_backoff_s=1.0):
                with attempt:
                    info = await self._tokenizer_info(model_id)
            self.models[model_id] = ModelInfo(model_id, Tokenizer.from_str(info.tokenizer_json),
                                              tuple(info.eos_token_ids), int(info.context_length))
            logger.info("model ready", model=model_id, context_length=info.context_length,
                        eos_token_ids=list(info.eos_token_ids))

    async def _tokenizer_info(self, model_id: str) -> tokenizer_pb2.TokenizerInfo:
        """GetTokenizerInfo; UNIMPLEMENTED means the target is some other gRPC server (a port
        taken over, a wrong address): said clearly, and retried like an absent tokenizer. A call
        that waited its whole timeout for a tokenizer still starting is retried too."""
        try:
            return await self._idempotent(self.stub.GetTokenizerInfo(
                tokenizer_pb2.TokenizerInfoRequest(model=model_id), timeout=self.timeout_s, wait_for_ready=True))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                logger.error("tokenizer target is not a tokenizer service; retrying", target=self.target,
                             details=exc.details())
                raise Unavailable(f"{self.target} does not serve llmserve.v1.Tokenizer") from exc
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                logger.warning("tokenizer service not reached yet; retrying", target=self.target)
                raise Unavailable(f"{self.target} did not answer within {self.timeout_s} s") from exc
            raise

    async def _idempotent(self, call: Awaitable[ReplyT]) -> ReplyT:
        """A call that may simply be made again: CANCELLED from the channel (our own cancellation
        raises asyncio.CancelledError instead) means the server went away mid-call, a tokenizer pod
        stopping or the process that held the port exiting, so it is retried like UNAVAILABLE."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                logger.warning("tokenizer call cancelled by its server; retrying", target=self.target)
                raise Unavailable(f"{self.target} cancelled the call (server going away)") from exc
            raise

    def get(self, model_id: str) -> ModelInfo:
        """The concrete model `model_id` (gateway.model_router resolves aliases); NOT_FOUND for one not served."""
        if model_id not in self.ids:
            raise NotFound(f"unknown model {model_id!r}; ListModels lists the served ones")
        info = self.models.get(model_id)
        if info is None:
            raise Unavailable(f"model {model_id} is not ready (tokenizer_svc not reached yet)")
        return info

    async def encode(self, model_id: str, text: str, messages, deadline: float | None,
                     allow_special_tokens: bool = False, tools: Sequence[pb.Tool] = ()) -> list[int]:
        """Token ids of text or chat messages (template applied with the generation prompt, `tools`
        rendered into it). Special tokens spelled in the input are plain text, except in `text` when
        `allow_special_tokens`."""
        request = tokenizer_pb2.EncodeRequest(model=model_id, text=text, messages=messages,
                                              allow_special_tokens=allow_special_tokens, tools=tools)
        caller_deadline = deadline
        cap = time.monotonic() + self.timeout_s * 3
        deadline = cap if deadline is None else min(deadline, cap)
        try:
            with tracing.span("tokenize", {tracing.REQUEST_MODEL: model_id}, tracing.SpanKind.CLIENT):
                async for attempt in retrying(deadline=deadline):
                    with attempt:
                        reply = await self._idempotent(self.stub.Encode(
                            request, timeout=min(self.timeout_s, remaining(deadline)),
                            metadata=tracing.outgoing_metadata()))
        except grpc.aio.AioRpcError as exc:
            caller_left = caller_deadline is None or time.monotonic() < caller_deadline
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and caller_left:
                raise Unavailable(f"tokenizer_svc did not answer within {self.timeout_s} s; retry") from exc
            raise                 # the caller's own deadline passed, or a code that keeps its meaning
        return list(reply.token_ids)

    def list(self) -> list[pb.ModelInfo]:
        """The concrete models (ListModels adds the aliases)."""
        return [pb.ModelInfo(id=m, context_length=self.context_length(m)) for m in self.ids]

    def context_length(self, model_id: str) -> int:
        return self.models[model_id].context_length if model_id in self.models else 0

    async def close(self) -> None:
        await self.channel.close()
