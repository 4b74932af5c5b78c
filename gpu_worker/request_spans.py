"""The spans of the requests one worker runs, children of each work item's gateway request span
(WorkItem.trace_context, llmserve/runtime/tracing.py):

    queue wait   item enqueued (gateway, or the handoff that requeued it) ─▶ this worker took it
    prefill      taken ─▶ its first token here   (ends at once: a worker killed later keeps it)
    decode       first token ─▶ final event, handoff, or superseded; one span, with the token and
                 step counts, and an event per preemption

A worker killed with -9 loses only its open decode spans: every ended span is exported within
the batch processor's short schedule delay. Only the engine loop calls this (no locking).
With tracing off every method returns at once and nothing is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Span

from gpu_worker.engine.sequence import SequenceStatus
from gpu_worker.requests import Tracked
from llmserve.runtime import clock, tracing
from llmserve.v1 import inference_pb2


@dataclass
class _Open:
    parent: Context | None
    attributes: dict
    span: Span | None             # prefill until the first token, then decode
    decoding: bool = False
    tokens: int = 0
    steps: int = 0
    preempted: bool = False


class RequestSpans:
    """Open spans by sequence id.

    Args:
        worker_id: this worker (the `llmserve.worker.id` attribute).
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._open: dict[int, _Open] = {}

    def admitted(self, tracked: Tracked) -> None:
        """The engine took the request: its queue wait ends, its prefill starts."""
        if not tracing.enabled():
            return
        item, now_s = tracked.item, clock.now_s()
        parent = tracing.item_context(item)
        attributes = {**tracing.item_attributes(item, self.worker_id), "llmserve.deliveries": item.deliveries}
        tracing.record_span("queue wait", parent, item.enqueued_unix_ms / 1000, tracked.admitted_unix_ms / 1000,
                            attributes)
        prefill = tracing.start_span("prefill", {**attributes, tracing.INPUT_TOKENS: len(item.prompt_token_ids),
                                                 "llmserve.resumed_tokens": len(item.generated_token_ids)},
                                     parent, now_s)
        self._open[tracked.seq.seq_id] = _Open(parent, attributes, prefill)

    def stepped(self, tracked: Tracked, new_tokens: int) -> None:
        """A step gave the request `new_tokens`: the first (the prefill's) ends its prefill and
        opens its decode, which counts the tokens and steps after it."""
        spans = self._open.get(tracked.seq.seq_id)
        if spans is None or not new_tokens:
            return
        if not spans.decoding:
            tracing.end_span(spans.span, {"llmserve.cached_tokens": tracked.seq.num_cached_prompt_tokens})
            spans.span = tracing.start_span("decode", spans.attributes, spans.parent)
            spans.decoding = True
            return
        if spans.preempted and spans.span is not None:
            spans.span.add_event("resumed", {"llmserve.tokens": spans.tokens})
        spans.preempted = False
        spans.tokens += new_tokens
        spans.steps += 1

    def check_preempted(self, tracked: Iterable[Tracked]) -> None:
        """After a step that preempted: an event on each decoding request sent back to wait."""
        if not self._open:
            return
        for t in tracked:
            spans = self._open.get(t.seq.seq_id)
            if spans is not None and spans.decoding and not spans.preempted and \
                    t.seq.status is SequenceStatus.WAITING and spans.span is not None:
                spans.preempted = True
                spans.span.add_event("preempted", {"llmserve.tokens": spans.tokens})

    def ended(self, tracked: Tracked, finish_reason: int, error: str = "") -> None:
        """The request's final event here: it finished, was cancelled, or failed (`error`)."""
        if tracked.seq.seq_id not in self._open:
            return
        reason = inference_pb2.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()
        self._end(tracked, {tracing.FINISH_REASONS: (reason,)} if finish_reason else {}, error)

    def moved(self, tracked: Tracked, why: str) -> None:
        """The request leaves this worker unfinished (`why`: handed back, superseded)."""
        spans = self._open.get(tracked.seq.seq_id)
        if spans is not None and spans.span is not None:
            spans.span.add_event(why, {"llmserve.tokens": spans.tokens})
        self._end(tracked, {"llmserve.moved": why})

    def _end(self, tracked: Tracked, attributes: dict, error: str = "") -> None:
        spans = self._open.pop(tracked.seq.seq_id, None)
        if spans is None:
            return
        counts = {tracing.OUTPUT_TOKENS: spans.tokens, "llmserve.decode.steps": spans.steps} if spans.decoding \
            else {}
        tracing.end_span(spans.span, {**counts, **attributes}, error)
