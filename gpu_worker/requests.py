"""Work items from the queue <-> engine sequences, and the per-request state the worker keeps."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from gpu_worker.engine.sequence import SamplingParams, Sequence
from llmserve import queue
from llmserve.clock import now_ms
from llmserve.grammar import GrammarCache, GrammarError
from llmserve.v1 import queue_pb2

# Grammars of the formats this worker has seen (by content): a repeated schema is derived once.
_GRAMMARS = GrammarCache(capacity=256)


def _grammar(item: queue_pb2.WorkItem) -> str:
    """The item's grammar: its tool-call grammar if any (built by the gateway), else its format's;
    "" when it has none or the format is invalid (validate_item refuses those)."""
    if item.sampling.tool_grammar:
        return item.sampling.tool_grammar
    try:
        return _GRAMMARS.get(item.sampling.response_format)
    except GrammarError:
        return ""


def sampling_params(item: queue_pb2.WorkItem) -> SamplingParams:
    """Engine parameters of a work item; an unset seed is derived from the request (stable across workers)."""
    s = item.sampling
    seed = s.seed or zlib.crc32(f"{item.tenant}:{item.request_id}".encode())
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p if s.top_p > 0 else 1.0, top_k=s.top_k,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty > 0 else 1.0,
        max_new_tokens=s.max_new_tokens, seed=seed, stop_token_ids=tuple(s.stop_token_ids),
        grammar=_grammar(item),
    )


def validate_item(item: queue_pb2.WorkItem, vocab_size: int) -> str:
    """Why the item cannot run ("" when it can)."""
    if not item.prompt_token_ids:
        return "prompt_token_ids: empty"
    if any(t >= vocab_size for t in (*item.prompt_token_ids, *item.generated_token_ids)):
        return f"prompt_token_ids: token id outside the vocabulary of {vocab_size}"
    try:
        _GRAMMARS.get(item.sampling.response_format)
    except GrammarError as e:
        return f"sampling.response_format: {e}"
    return ""


@dataclass(eq=False)
class Tracked:
    """A request this worker holds: its sequence, where it came from, what was published."""

    item: queue_pb2.WorkItem
    seq: Sequence
    entry_id: str                       # inbox entry (batch) it arrived in
    admitted_unix_ms: int = field(default_factory=now_ms)
    sent_first: bool = False
    done: bool = False                  # final event written (or handed back)

    @classmethod
    def from_item(cls, item: queue_pb2.WorkItem, entry_id: str) -> Tracked:
        seq = Sequence(list(item.prompt_token_ids), sampling_params(item),
                       prior_output_ids=list(item.generated_token_ids), request_id=item.request_id,
                       cache_salt=item.cache_salt, priority=item.priority)
        return cls(item, seq, entry_id)

    def expired(self, at_ms: int) -> bool:
        return queue.is_expired(self.item, at_ms)

    def handoff_item(self) -> queue_pb2.WorkItem:
        """The work item to requeue: same request, with every token produced so far."""
        item = queue_pb2.WorkItem()
        item.CopyFrom(self.item)
        del item.generated_token_ids[:]
        item.generated_token_ids.extend([*self.seq.prior_output_ids, *self.seq.output_token_ids])
        item.enqueued_unix_ms = now_ms()
        return item
