"""n choices of one prompt (GenerateRequest.n, OpenAI's `n`) at the gateway.

One request, one work item (WorkItem.n), one events stream: the worker runs the choices as
separate sequences (seed + i; docs/logprobs.md) and tags each event with its choice. Here:

    check / count     n in 1..MAX_CHOICES (0 = 1)
    reserved_tokens   what admission reserves: prompt + max_new_tokens per choice
    ChoicesBuilder    one OutputBuilder per choice behind OutputBuilder's face: chunks name
                      their choice, `next_index` counts every choice's tokens, done when all are
    collect           the chunks of a whole call -> CompleteResponse (choice 0 also on top)
    cancel_choice     a choice that ended at a stop string while others run on: its own cancel
                      key (llmserve/protocol/keys.py) makes the worker stop that sequence within a step
                      (the last choice to end ends the request, and the flow cancels it whole)

Concurrency: the request holds one lease (max_concurrent counts requests, as the rate does);
the tokens of all its choices count against tokens_per_minute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import structlog
from tokenizers import Tokenizer

from gateway.output import OutputBuilder
from llmserve.protocol import keys
from llmserve.runtime import redis_client
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)

MAX_CHOICES = 16


def count(request: pb.GenerateRequest) -> int:
    return request.n or 1


def check(request: pb.GenerateRequest) -> None:
    if request.n > MAX_CHOICES:
        raise InvalidArgument("n", f"must be in 1..{MAX_CHOICES}")


def reserved_tokens(prompt_tokens: int, max_new_tokens: int, n: int) -> int:
    """Tokens reserved at admission: every choice may use its prompt and max_new_tokens."""
    return (prompt_tokens + max_new_tokens) * n


class ChoicesBuilder:
    """Token events of all choices -> chunks, each choice cut as its own OutputBuilder cuts it.

    Args:
        request_id: the request.
        tokenizer: the model's.
        stops: stop strings (each choice stops on its own).
        n: how many choices the request runs.
    """

    def __init__(self, request_id: str, tokenizer: Tokenizer, stops: Sequence[str], n: int) -> None:
        self.choices = [OutputBuilder(request_id, tokenizer, stops) for _ in range(n)]

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    @property
    def next_index(self) -> int:
        """Completion tokens taken, over every choice."""
        return sum(c.next_index for c in self.choices)

    def feed(self, event: queue_pb2.TokenEvent) -> pb.GenerateResponse | None:
        if event.choice_index >= len(self.choices):
            logger.error("token event of an unknown choice", choice=event.choice_index, n=len(self.choices))
            return None
        chunk = self.choices[event.choice_index].feed(event)
        if chunk is not None:
            chunk.choice_index = event.choice_index
        if event.final and not event.dispatch_epoch:
            # written by the batcher for the whole item (dropped before any worker ran it: cancelled
            # before it started): no choice has tokens, and none will get an event of its own
            for choice in self.choices:
                if not choice.done:
                    choice.cancelled()
        return chunk

    def ended_alone(self, chunk: pb.GenerateResponse, event: queue_pb2.TokenEvent) -> bool:
        """`chunk` ended its choice here (a stop string, before the worker's final event of it)
        while other choices still run: the worker must be told to stop that choice."""
        return bool(chunk.finish_reason) and not event.final and not self.done

    def cancelled(self) -> pb.GenerateResponse:
        """The last chunk of a request cancelled without final events: it ends every open choice
        (its choice_index names the first of them)."""
        open_choices = [i for i, c in enumerate(self.choices) if not c.done] or [0]
        chunks = [self.choices[i].cancelled() for i in open_choices]
        chunks[0].choice_index = open_choices[0]
        return chunks[0]


async def cancel_choice(redis: redis_client.AnyRedis, tenant: str, request_id: str, choice: int,
                        ttl_s: int) -> None:
    """Tell the worker (this one, or the next after a failover) to stop one choice of the request."""
    await redis.set(keys.choice_cancel_key(keys.cancel_key(tenant, request_id), choice), "1", ex=ttl_s)


async def collect(request_id: str, chunks: AsyncIterator[pb.GenerateResponse]) -> pb.CompleteResponse:
    """The whole completion of a call: every choice in `choices`, choice 0 also in the top-level fields,
    usage of the whole request."""
    parts: dict[int, list[pb.GenerateResponse]] = {}
    reply = pb.CompleteResponse(request_id=request_id)
    async for chunk in chunks:
        parts.setdefault(chunk.choice_index, []).append(chunk)
        if chunk.HasField("usage"):
            reply.usage.CopyFrom(chunk.usage)
    for index in sorted(parts or {0: []}):
        reply.choices.append(_choice(index, parts.get(index, [])))
    first = reply.choices[0]
    reply.text, reply.finish_reason, reply.choice_index = first.text, first.finish_reason, first.choice_index
    reply.token_ids.extend(first.token_ids)
    reply.logprobs.extend(first.logprobs)
    reply.tool_calls.extend(first.tool_calls)
    return reply


def _choice(index: int, chunks: list[pb.GenerateResponse]) -> pb.CompleteChoice:
    choice = pb.CompleteChoice(choice_index=index, text="".join(c.text for c in chunks))
    for chunk in chunks:
        choice.token_ids.extend(chunk.token_ids)
        choice.logprobs.extend(chunk.logprobs)
        choice.tool_calls.extend(chunk.tool_calls)
        choice.finish_reason = chunk.finish_reason or choice.finish_reason
    return choice
