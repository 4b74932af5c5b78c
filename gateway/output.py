"""Token events → GenerateResponse chunks: dedupe by index, incremental
detokenization, stop strings.

The chunks are a pure function of the event sequence, so a resumed stream cuts
them at the same places as the first one; `resume_from` then drops the chunks
the client already has.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from tokenizers import Tokenizer

from gateway import logprobs
from gateway.detokenizer import IncrementalDetokenizer, TokenTexts
from gateway.stops import StopMatcher
from llmserve.protocol import queue
from llmserve.runtime.errors import Unavailable
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)


class OutputBuilder:
    """Feed TokenEvents in stream order; get the chunks to send. `done` once a final chunk went out."""

    def __init__(self, request_id: str, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.request_id = request_id
        self.detok = IncrementalDetokenizer(tokenizer)
        self.texts = TokenTexts(tokenizer)
        self.matcher = StopMatcher(stops)
        self.next_index = 0       # completion tokens taken so far
        self.taken: list[int] = []   # their ids
        self.epoch = 0            # newest dispatch epoch seen
        self.finish_reason = pb.FINISH_REASON_UNSPECIFIED
        self.done = False
        self.first_event: queue_pb2.TokenEvent | None = None

    def _new_tokens(self, event: queue_pb2.TokenEvent) -> list[int]:
        """The tokens of `event` not seen before (events may repeat after a redelivery).

        A re-run after a failover (a newer dispatch epoch) repeats the tokens already taken:
        they must be the same ones (seeded sampling makes them so), or the completion would
        be two runs spliced together; then the stream fails instead.
        """
        ids = list(event.token_ids)
        if event.dispatch_epoch < self.epoch:
            return []           # a fenced-off run's late event: only the newest run counts
        if event.dispatch_epoch > self.epoch:
            self.epoch = event.dispatch_epoch
            overlap = self.taken[event.index:event.index + len(ids)]
            if overlap != ids[:len(overlap)]:
                logger.error("re-run diverged from the tokens already sent", index=event.index,
                             epoch=event.dispatch_epoch)
                raise Unavailable("the request was re-run after a worker failure and diverged; "
                                  "retry it under a new request_id")
        if event.index > self.next_index:
            logger.warning("gap in token events", expected=self.next_index, got=event.index)
            if event.final:  # never end a completion with tokens missing from its middle
                raise Unavailable(f"token events {self.next_index}..{event.index - 1} missing")
            return []
        return ids[self.next_index - event.index:]

    def feed(self, event: queue_pb2.TokenEvent) -> pb.GenerateResponse | None:
        """The chunk this event yields (None when it adds nothing); raises the event's error."""
        if self.done:
            return None
        if self.first_event is None:
            self.first_event = event
        ids = self._new_tokens(event)
        # one entry per token of the event when the request asked: the new tokens' are its tail
        lps = logprobs.with_text(event.logprobs[len(event.token_ids) - len(ids):], self.texts) \
            if ids and event.logprobs else []
        start = self.next_index
        self.next_index += len(ids)
        self.taken += ids
        result = self.matcher.feed(self.detok.feed(ids)) if ids else None
        text = result.text if result else ""
        if result and result.stopped:
            return self._final(start, ids, text, pb.FINISH_REASON_STOP, lps)
        if event.final:
            if event.HasField("error") and event.error.code:
                self.done = True
                raise queue.error_of(event)
            tail = self.matcher.feed(self.detok.flush())
            text += tail.text + ("" if tail.stopped else self.matcher.flush())
            reason = pb.FINISH_REASON_STOP if tail.stopped else event.finish_reason
            return self._final(start, ids, text, reason or pb.FINISH_REASON_STOP, lps)
        if not ids:
            return None
        return pb.GenerateResponse(request_id=self.request_id, text=text, token_ids=ids, index=start, logprobs=lps)

    def cancelled(self) -> pb.GenerateResponse:
        """The last chunk of a stream cancelled without a final event from the worker."""
        return self._final(self.next_index, [], "", pb.FINISH_REASON_CANCELLED)

    def _final(self, start: int, ids: list[int], text: str, reason: pb.FinishReason,
               lps: Sequence[pb.TokenLogprob] = ()) -> pb.GenerateResponse:
        self.done = True
        self.finish_reason = reason
        return pb.GenerateResponse(request_id=self.request_id, text=text, token_ids=ids, index=start,
                                   finish_reason=reason, logprobs=lps)
