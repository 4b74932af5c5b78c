"""Work items from the queue <-> engine sequences, and the per-request state the worker keeps."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from gpu_worker.engine.sequence import SamplingParams, Sequence
from llmserve.protocol import keys, queue, slo
from llmserve.protocol.grammar import GrammarCache, GrammarError
from llmserve.runtime.clock import now_ms
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


_MASK64 = (1 << 64) - 1


def sampling_params(item: queue_pb2.WorkItem, choice: int = 0) -> SamplingParams:
    """Engine parameters of a work item's `choice`; an unset seed is derived from the request (stable
    across workers), and choice i draws with seed + i (docs/logprobs.md)."""
    s = item.sampling
    seed = ((s.seed or zlib.crc32(f"{item.tenant}:{item.request_id}".encode())) + choice) & _MASK64
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p if s.top_p > 0 else 1.0, top_k=s.top_k,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty > 0 else 1.0,
        max_new_tokens=s.max_new_tokens, seed=seed, stop_token_ids=tuple(s.stop_token_ids),
        grammar=_grammar(item), logprobs=s.logprobs, top_logprobs=s.top_logprobs,
    )


def validate_item(item: queue_pb2.WorkItem, vocab_size: int) -> str:
    """Why the item cannot run ("" when it can)."""
    if not item.prompt_token_ids:
        return "prompt_token_ids: empty"
    generated = [t for c in item.choices for t in c.generated_token_ids]
    if any(t >= vocab_size for t in (*item.prompt_token_ids, *item.generated_token_ids, *generated)):
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
    def from_item(cls, item: queue_pb2.WorkItem, entry_id: str, choice: int = 0, prior: list[int] | None = None,
                  leader: Sequence | None = None) -> Tracked:
        """One choice of the item, continuing after `prior` (default: the item's generated_token_ids)."""
        prior = list(item.generated_token_ids) if prior is None else prior
        seq = Sequence(list(item.prompt_token_ids), sampling_params(item, choice), prior_output_ids=prior,
                       request_id=item.request_id, cache_salt=item.cache_salt, priority=item.priority,
                       slo=slo.targets_of(item), arrival_unix_ms=item.arrival_unix_ms, tenant=item.tenant,
                       tenant_weight=item.tenant_weight or 1.0, choice_index=choice, leader=leader)
        return cls(item, seq, entry_id)

    @classmethod
    def choices_of(cls, item: queue_pb2.WorkItem, entry_id: str) -> list[Tracked]:
        """Every choice the item runs (all n, or the handed-back ones): the first, then the rest led
        by it (they wait for its prompt, then share its blocks)."""
        progress = [(c.index, list(c.generated_token_ids)) for c in item.choices] or \
            [(i, list(item.generated_token_ids)) for i in range(max(1, item.n))]
        first = cls.from_item(item, entry_id, *progress[0])
        return [first, *(cls.from_item(item, entry_id, i, prior, first.seq) for i, prior in progress[1:])]

    @property
    def cancel_keys(self) -> tuple[str, ...]:
        """The keys whose existence stops this choice: the request's, and (n > 1) the choice's own."""
        if max(1, self.item.n) == 1 or not self.item.cancel_key:
            return (self.item.cancel_key,)
        return self.item.cancel_key, keys.choice_cancel_key(self.item.cancel_key, self.seq.choice_index)

    def expired(self, at_ms: int) -> bool:
        return queue.is_expired(self.item, at_ms)

    def handoff_item(self) -> queue_pb2.WorkItem:
        """The work item to requeue: same request, with every token produced so far."""
        return handoff_items([self])[0]

    @property
    def produced(self) -> list[int]:
        return [*self.seq.prior_output_ids, *self.seq.output_token_ids]


def handoff_items(unfinished: list[Tracked]) -> list[queue_pb2.WorkItem]:
    """The work items to requeue, one per request (a request's choices go back together: one
    item, one dispatch, so no choice's dispatch fences another's out), with every token produced."""
    by_item: dict[int, list[Tracked]] = {}
    for t in unfinished:
        by_item.setdefault(id(t.item), []).append(t)
    return [_handoff(group) for group in by_item.values()]


def _handoff(group: list[Tracked]) -> queue_pb2.WorkItem:
    item = queue_pb2.WorkItem()
    item.CopyFrom(group[0].item)
    del item.generated_token_ids[:], item.choices[:]
    if max(1, item.n) == 1:
        item.generated_token_ids.extend(group[0].produced)
    else:
        item.choices.extend(queue_pb2.ChoiceProgress(index=t.seq.choice_index, generated_token_ids=t.produced)
                            for t in group)
    item.enqueued_unix_ms = now_ms()
    return item
