"""Speculative decoding by prompt lookup: draft a sequence's next tokens from its own context.

The latest n-gram of the context (n from max_ngram down to min_ngram) is looked up earlier in the
context, prompt or output; what followed its latest earlier occurrence is the draft:

    context   ... the cat sat on the mat . the cat |
                      ^^^^^^^ earlier "the cat"       ^^^^^^^ the latest 2-gram
    draft     sat on the mat                          (what followed, up to num_tokens tokens)

The next step computes the real last token and the draft in one go (a chunk of 1 + k positions,
one logits row each), and the engine samples those rows in order as it would sample decodes,
keeping drafted tokens while each equals the draw (engine.py `_verify`). A draw is the same
function of (logits, seed, position) either way and the kernels give a row the same bits whatever
else the step computes, so output is token for token what plain decoding gives, greedy or sampled
(hence the sampling distribution is unchanged too). A wrong draft costs its rows' compute; it pays
where a step's time is weight reads, i.e. with few sequences running, so drafting stops above
`max_running` sequences.

No context match, no draft: a sequence whose text never repeats costs nothing.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from gpu_worker.engine.sequence import Sequence


@dataclass(frozen=True)
class SpeculationConfig:
    num_tokens: int = 0          # drafted tokens a step at most (0 = off)
    max_running: int = 1         # draft only while at most this many sequences run
    min_ngram: int = 2           # the shortest context suffix looked up
    max_ngram: int = 4           # ... and the longest (tried first)
    max_temperature: float = math.inf  # draft only for sequences sampled at most this hot (greedy is 0)


class NgramIndex:
    """Where each n-gram of one growing context last occurred: n-gram -> the position after it.

    An n-gram is indexed once a token follows it, so the context's own suffix never matches itself.
    """

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.next_position: dict[tuple[int, ...], int] = {}
        self.indexed = 0                       # n-grams ending before this position are in

    def update(self, tokens: list[int]) -> None:
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.next_position[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix found."""
        self.update(tokens)
        for n in self.sizes:
            if len(tokens) > n:
                start = self.next_position.get(tuple(tokens[-n:]))
                if start is not None:
                    return tokens[start:start + limit]
        return []


class PromptLookup:
    """Drafts for a planned step's decodes; the scheduler fits them into what the plan left
    (Scheduler.add_drafts), the engine verifies them (LLMEngine._verify).

    Args:
        config: draft length, when to draft, n-gram sizes.
        context_length: the model's; a draft never runs a sequence past it.
    """

    def __init__(self, config: SpeculationConfig, context_length: int) -> None:
        assert config.num_tokens >= 0 and 1 <= config.min_ngram <= config.max_ngram
        self.config = config
        self.context_length = context_length
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    @property
    def enabled(self) -> bool:
        return self.config.num_tokens > 0

    def propose(self, decodes: list[Sequence], num_running: int) -> list[tuple[Sequence, list[int]]]:
        """(sequence, draft) for the decodes of a planned step that have one, when at most
        `max_running` sequences run (those sampled hotter than `max_temperature` draft nothing)."""
        if not self.enabled or num_running > self.config.max_running:
            return []
        drafts = [(seq, self._draft(seq)) for seq in decodes if seq.params.temperature <= self.config.max_temperature]
        return [(seq, draft) for seq, draft in drafts if draft]

    def _draft(self, seq: Sequence) -> list[int]:
        # every kept token and the one sampled after them must fit the request and the context
        room = min(self.config.num_tokens, seq.params.max_new_tokens - seq.num_generated - 1,
                   self.context_length - seq.num_tokens - 1)
        if room <= 0:
            return []
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.config.min_ngram, self.config.max_ngram)
        return index.draft(seq.token_ids, room)
