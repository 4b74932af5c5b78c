"""Real pieces around a gateway under test: a Tokenizer gRPC server on the real
SmolLM2 tokenizer, and a scripted worker that reads the real work streams and
writes real token-event streams (behaviour chosen by request_id prefix)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import redis

from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2, tokenizer_pb2, tokenizer_pb2_grpc

ANSWER = "The capital of France is Paris. It is a beautiful city with many museums."
MODEL = "smollm2-135m"


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, model_tokenizer) -> None:
        self.mt = model_tokenizer

    async def Encode(self, request, context):
        if request.messages:
            ids = self.mt.encode_chat([{"role": m.role, "content": m.content} for m in request.messages])
        else:
            ids = self.mt.encode(request.text, special_tokens_as_text=not request.allow_special_tokens)
        return tokenizer_pb2.EncodeResponse(token_ids=ids)

    async def GetTokenizerInfo(self, request, context):
        return tokenizer_pb2.TokenizerInfo(model=MODEL, tokenizer_json=self.mt.to_json(),
                                           eos_token_ids=self.mt.eos_token_ids, context_length=self.mt.context_length)


async def start_tokenizer_server(model_tokenizer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(model_tokenizer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@dataclass
class ScriptedWorker:
    """Reads every priority's work stream (XREAD + XDEL) and answers by request_id prefix:

        idle-*   never dispatched (stays in the work stream), never answered
        err-*    final error UNAVAILABLE
        late-*   dispatched, first event only after 3 s (a long prefill), then like other
        hold-*   holds the request 200 ms (counted in active/peak), then answers
        slow-*   one token / 50 ms until cancelled (final CANCELLED)
        other    ANSWER, 2 tokens per event, final LENGTH
    """

    redis: object
    answer_ids: list[int]
    items: list[queue_pb2.WorkItem] = field(default_factory=list)
    saw_cancel: set[str] = field(default_factory=set)
    tasks: set = field(default_factory=set)
    active: int = 0
    peak: int = 0       # most requests of one tenant being served at once, worker side

    async def start(self) -> asyncio.Task:
        """Serves from each work stream's present end, positioned before this returns: XREAD's "$"
        would miss an entry added before the first read or between two blocking reads."""
        streams = {}
        for priority in keys.PRIORITY_ORDER:
            stream = keys.work_stream(MODEL, priority)
            newest = await self.redis.xrevrange(stream, count=1)
            streams[stream] = redis_client.text(newest[0][0]) if newest else "0-0"
        return asyncio.create_task(self.run(streams))

    async def run(self, streams: dict[str, str]) -> None:
        while True:
            try:
                reply = await self.redis.xread(streams, block=200)
            except redis.ConnectionError:   # a test dropped the connection: read on from where it was
                continue
            for stream, entries in reply or ():
                for entry_id, fields in entries:
                    streams[stream.decode()] = entry_id
                    try:
                        item = queue.decode_item(fields)
                    except queue.Undecodable:
                        continue
                    if not item.request_id.startswith("idle-"):  # idle items stay queued, never dispatched
                        await self.redis.xdel(stream, entry_id)
                    self.items.append(item)
                    task = asyncio.create_task(self.serve(item))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)

    async def emit(self, item, **kw) -> None:
        event = queue_pb2.TokenEvent(request_id=item.request_id, admitted_unix_ms=item.enqueued_unix_ms + 1,
                                     prompt_tokens=len(item.prompt_token_ids), **kw)
        await self.redis.xadd(item.events_key, queue.event_entry(event))
        await self.redis.expire(item.events_key, 600)

    async def serve(self, item) -> None:
        rid = item.request_id
        if rid.startswith("hold-"):
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                await asyncio.sleep(0.2)
                return await self.emit(item, index=0, token_ids=self.answer_ids[:2], final=True,
                                       finish_reason=pb.FINISH_REASON_LENGTH)
            finally:
                self.active -= 1
        if rid.startswith("idle-"):
            return
        if rid.startswith("err-"):
            return await self.emit(item, final=True, error=queue_pb2.EventError(code="UNAVAILABLE", message="boom"))
        if rid.startswith("slow-"):
            return await self.serve_slow(item)
        if rid.startswith("late-"):
            await asyncio.sleep(3.0)  # a long prefill: dispatched, but no event for a while
        ids = self.answer_ids[:item.sampling.max_new_tokens]
        for start in range(0, len(ids), 2):
            if await self.redis.exists(item.cancel_key):
                self.saw_cancel.add(rid)
                return await self.emit(item, index=start, final=True, finish_reason=pb.FINISH_REASON_CANCELLED)
            last = start + 2 >= len(ids)
            await self.emit(item, index=start, token_ids=ids[start:start + 2], final=last,
                            finish_reason=pb.FINISH_REASON_LENGTH if last else 0)
            await asyncio.sleep(0.01)

    async def serve_slow(self, item) -> None:
        for i in range(item.sampling.max_new_tokens):
            if await self.redis.exists(item.cancel_key):
                self.saw_cancel.add(item.request_id)
                return await self.emit(item, index=i, final=True, finish_reason=pb.FINISH_REASON_CANCELLED)
            await self.emit(item, index=i, token_ids=[self.answer_ids[i % len(self.answer_ids)]])
            await asyncio.sleep(0.05)
        await self.emit(item, index=item.sampling.max_new_tokens, final=True, finish_reason=pb.FINISH_REASON_LENGTH)
