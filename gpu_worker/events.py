"""Token events: one TokenEvent per sequence per step, all of a step in one Redis pipeline.

Each write is fenced (llmserve/protocol/fencing.py): Redis refuses it when the request was
dispatched again elsewhere since this worker got it, and the publisher reports which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from gpu_worker.engine.sequence import TokenLogprobs
from gpu_worker.requests import Tracked
from llmserve.protocol import fencing, keys, queue
from llmserve.runtime import redis_client
from llmserve.runtime.errors import ServiceError
from llmserve.v1 import inference_pb2, queue_pb2


@dataclass(frozen=True)
class Emission:
    """One event to write: new tokens and, on the last one, how the request ended."""

    tracked: Tracked
    token_ids: tuple[int, ...] = ()
    # position of token_ids[0] in the completion, fixed when the event is queued: events can wait
    # (Redis down) while the sequence goes on generating
    index: int = 0
    final: bool = False
    finish_reason: int = 0
    error: ServiceError | None = None   # on the last event of a request that failed


def build_event(e: Emission, worker_id: str) -> queue_pb2.TokenEvent:
    seq = e.tracked.seq
    event = queue_pb2.TokenEvent(
        request_id=e.tracked.item.request_id, index=e.index,
        token_ids=list(e.token_ids), worker_id=worker_id, final=e.final,
        dispatch_epoch=e.tracked.item.dispatch_epoch, choice_index=seq.choice_index,
    )
    if seq.params.logprobs and e.token_ids:
        start = e.index - seq.index_offset                 # into seq.output_logprobs
        event.logprobs.extend(_logprob(t, entry) for t, entry in
                              zip(e.token_ids, seq.output_logprobs[start:start + len(e.token_ids)]))
    if e.final:
        event.finish_reason = cast(inference_pb2.FinishReason, e.finish_reason)
        if e.error is not None:
            event.error.CopyFrom(queue.event_error(e.error))
    if not e.tracked.sent_first:
        event.prompt_tokens = seq.num_prompt_tokens
        event.cached_prompt_tokens = seq.num_cached_prompt_tokens
        event.admitted_unix_ms = e.tracked.admitted_unix_ms
    return event


def _logprob(token_id: int, entry: TokenLogprobs) -> inference_pb2.TokenLogprob:
    """The wire form of one position's logprobs (token text is the gateway's to fill in)."""
    return inference_pb2.TokenLogprob(token_id=token_id, logprob=entry.logprob, top=[
        inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in entry.top])


class EventPublisher:
    """Writes a step's events, then acks the inbox entries whose requests all ended.

    Args:
        redis: client.
        model: model id (inbox key).
        worker_id: this worker.
        ttl_s: events stream TTL, renewed on every write.
        shard: the queue cell the worker joined (inbox key).
    """

    def __init__(self, redis: redis_client.AnyRedis, model: str, worker_id: str, ttl_s: int, shard: int = 0) -> None:
        self.redis = redis
        self.inbox = keys.inbox_stream(model, worker_id, shard)
        self.worker_id = worker_id
        self.ttl_s = ttl_s

    async def publish(self, emissions: list[Emission], ack_entries: list[str]) -> list[Emission]:
        """Fenced XADD per event, then XACK/XDEL the finished inbox entries, in one pipeline.

        Returns:
            the emissions Redis refused: their requests now belong to a newer dispatch.
        """
        if not emissions and not ack_entries:
            return []
        pipe = self.redis.pipeline(transaction=False)
        self.queue_events(pipe, emissions)
        self.queue_acks(pipe, ack_entries)
        return self.refused(emissions, await pipe.execute())

    def queue_events(self, pipe, emissions: list[Emission]) -> None:
        """Queue one fenced XADD per emission on `pipe` (one reply each, 0 when refused)."""
        for e in emissions:
            fencing.fenced_xadd(pipe, e.tracked.item, build_event(e, self.worker_id), self.ttl_s)

    def queue_acks(self, pipe, ack_entries: list[str]) -> None:
        """Queue XACK/XDEL of finished inbox entries on `pipe`, after their events."""
        if ack_entries:
            queue.ack_and_delete(pipe, self.inbox, keys.INBOX_GROUP, ack_entries)

    @staticmethod
    def refused(emissions: list[Emission], replies: list) -> list[Emission]:
        """Record what was written (the first replies, one per emission); return the emissions refused."""
        refused = []
        for e, written in zip(emissions, replies):
            if written:
                e.tracked.sent_first = True
                e.tracked.done = e.tracked.done or e.final
            else:
                refused.append(e)
        return refused
