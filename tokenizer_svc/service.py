"""`llmserve.v1.Tokenizer`: the gRPC front of the tokenizer pool.

Each call: pick the model (empty = default; unknown → NOT_FOUND), check limits
(INVALID_ARGUMENT), look the exact request up in the LRU cache, else run it on
the pool under the caller's deadline (DEADLINE_EXCEEDED).

The pool's read loops are supervised (llmserve/runtime/tasks.py): one that raises fails the service
(`failure`, then the stop event: serve() goes NOT_SERVING and exits 1).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from pathlib import Path

import grpc
import structlog

from llmserve.catalog import model_store
from llmserve.runtime import tracing
from llmserve.runtime.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from llmserve.v1 import tokenizer_pb2 as pb
from llmserve.v1 import tokenizer_pb2_grpc
from tokenizer_svc import metrics
from tokenizer_svc.cache import LRUCache
from tokenizer_svc.config import TokenizerSettings
from tokenizer_svc.loader import ModelTokenizer, load_tokenizer
from tokenizer_svc.pool import Pool
from tokenizer_svc.validation import Limits, Op, batch_size, decode_op, encode_op

logger = structlog.get_logger(__name__)


def load_models(specs: list[str]) -> dict[str, ModelTokenizer]:
    """Model id → tokenizer, in the order given (the first is the default). Ids whose weights are
    the same file (two versions of one model) share one loaded tokenizer."""
    models: dict[str, ModelTokenizer] = {}
    by_path: dict[Path, ModelTokenizer] = {}
    for spec in specs:
        model_id, path = model_store.model_id(spec), model_store.resolve(spec).resolve()
        if path not in by_path:
            by_path[path] = load_tokenizer(path)
            logger.info("tokenizer loaded", model=model_id, vocab_size=by_path[path].vocab_size,
                        context_length=by_path[path].context_length)
        else:
            logger.info("tokenizer shared", model=model_id, path=str(path))
        models[model_id] = by_path[path]
    return models


class TokenizerService(tokenizer_pb2_grpc.TokenizerServicer):
    service_names = (pb.DESCRIPTOR.services_by_name["Tokenizer"].full_name,)

    def __init__(self, settings: TokenizerSettings, models: dict[str, ModelTokenizer] | None = None,
                 stop: asyncio.Event | None = None) -> None:
        """`models` (id → tokenizer) when already loaded; else start() loads settings.models.
        `stop`: the event serve() waits on, set when a pool task died."""
        self.settings = settings
        self.stop_event = stop
        self.failure: BaseException | None = None
        self.limits = Limits(settings.max_text_bytes, settings.max_messages, settings.max_batch_requests,
                             settings.max_decode_ids)
        self.models: dict[str, ModelTokenizer] = models or {}
        self.infos: dict[str, pb.TokenizerInfo] = {}
        self.cache: LRUCache[array] = LRUCache(settings.cache_bytes)
        self.pool: Pool | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(self, server)

    async def start(self) -> None:
        if not self.models:
            loop = asyncio.get_running_loop()
            self.models = await loop.run_in_executor(None, load_models, self.settings.model_specs())
        self.infos = {name: pb.TokenizerInfo(model=name, tokenizer_json=m.to_json(), eos_token_ids=m.eos_token_ids,
                                             context_length=m.context_length) for name, m in self.models.items()}
        self.pool = Pool(self.models, self.settings.pool_size(), self.settings.long_text_bytes,
                         self.settings.segment_cache_bytes, on_failure=self._fail)
        await self.pool.start()
        logger.info("tokenizer pool ready", processes=self.settings.pool_size(), pids=self.pool.pids())

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        if self.stop_event is not None:
            self.stop_event.set()

    async def drain(self) -> None:
        """Nothing to stop early: in-flight calls finish on the pool, which close() stops after them."""

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    # -------------------------------------------------------------------------------------- RPCs

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        with tracing.server_span("llmserve.v1.Tokenizer/Encode", context.invocation_metadata()) as span:
            deadline = self._deadline(context)
            model = self._model(request.model)
            ids = await self._encode(model, encode_op(request, self.limits), deadline, "")
            if span is not None:
                span.set_attributes({tracing.REQUEST_MODEL: model, tracing.INPUT_TOKENS: len(ids)})
            return pb.EncodeResponse(token_ids=ids)

    async def EncodeBatch(self, request: pb.EncodeBatchRequest,
                          context: grpc.aio.ServicerContext) -> pb.EncodeBatchResponse:
        with tracing.server_span("llmserve.v1.Tokenizer/EncodeBatch", context.invocation_metadata()):
            return await self._encode_batch(request, context)

    async def _encode_batch(self, request: pb.EncodeBatchRequest,
                            context: grpc.aio.ServicerContext) -> pb.EncodeBatchResponse:
        deadline = self._deadline(context)
        batch_size(request, self.limits)
        work = [(self._model(r.model), encode_op(r, self.limits, f"requests[{i}]."), f"requests[{i}].")
                for i, r in enumerate(request.requests)]
        results = await asyncio.gather(*(self._encode(model, op, deadline, prefix) for model, op, prefix in work))
        return pb.EncodeBatchResponse(results=[pb.EncodeResponse(token_ids=ids) for ids in results])

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        deadline = self._deadline(context)
        model = self._model(request.model)
        op = decode_op(request, self.limits, self.models[model].vocab_size)
        started = time.perf_counter()
        text = await self._pool().submit(op.name, model, op.args, op.cost, deadline)
        metrics.REQUEST_LATENCY.labels(model=model, op=op.name).observe(time.perf_counter() - started)
        return pb.DecodeResponse(text=text)

    async def GetTokenizerInfo(self, request: pb.TokenizerInfoRequest,
                               context: grpc.aio.ServicerContext) -> pb.TokenizerInfo:
        return self.infos[self._model(request.model)]

    # ---------------------------------------------------------------------------------- helpers

    def _model(self, name: str) -> str:
        """The served model id for a request's model field (empty = the default)."""
        if not name:
            return next(iter(self.models))
        if name not in self.models:
            raise NotFound(f"model {name!r} is not served here; served: {', '.join(self.models)}")
        return name

    def _pool(self) -> Pool:
        if self.pool is None:   # a call that beat start()
            raise Unavailable("tokenizer pool is starting")
        return self.pool

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        """Absolute time.monotonic() deadline: the caller's, capped by request_timeout_s."""
        left = context.time_remaining()
        timeout = self.settings.request_timeout_s if left is None else min(left, self.settings.request_timeout_s)
        if timeout <= 0:
            raise DeadlineExceeded("deadline already passed")
        return time.monotonic() + timeout

    async def _encode(self, model: str, op: Op, deadline: float, prefix: str) -> array:
        """Token ids of one encode op: from the request cache, else from the pool."""
        started = time.perf_counter()
        key = (model, op.name, op.args)
        ids = self._cached(key)
        if ids is None:
            try:
                ids = await self._pool().submit(op.name, model, op.args, op.cost, deadline)
            except InvalidArgument as exc:  # the chat template refused the messages
                raise (_field_error(prefix, exc) if prefix else exc) from None
            self._remember(key, ids, op.cost)
        metrics.REQUEST_LATENCY.labels(model=model, op=op.name).observe(time.perf_counter() - started)
        metrics.TOKENS.labels(model=model).inc(len(ids))
        return ids

    def _cached(self, key: tuple) -> array | None:
        if not self.cache.max_bytes:
            return None
        ids = self.cache.get(key)
        metrics.CACHE_LOOKUPS.labels(cache="request", result="miss" if ids is None else "hit").inc()
        return ids

    def _remember(self, key: tuple, ids: array, cost: int) -> None:
        if self.cache.max_bytes:
            self.cache.put(key, ids, cost + 4 * len(ids) + 64)
            metrics.CACHE_BYTES.set(self.cache.bytes)


def _field_error(prefix: str, exc: InvalidArgument) -> InvalidArgument:
    return InvalidArgument(prefix + exc.field, exc.message.split(": ", 1)[-1])
