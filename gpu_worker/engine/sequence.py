"""A sequence being generated: its tokens, sampling parameters and lifecycle.

Token layout of a sequence (context = prompt + output):

    token_ids:  [ prompt ............ | output ...... ]
                  <-- num_computed_tokens -->|          KV of these sits in the paged cache
                                             ^ the next forward computes from here

A handed-off request arrives with output already produced elsewhere: those tokens
are context like the prompt, and `index_offset` makes event indices continue.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from llmserve.protocol.slo import Targets, next_token_deadline_ms
from llmserve.v1 import inference_pb2

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Failure(enum.Enum):
    """Why the engine ended a sequence without finishing it (the worker maps it to a status)."""

    DOES_NOT_FIT = "does_not_fit"    # the prompt needs more KV blocks than the whole cache
    DEADLINE = "deadline"            # its deadline passed while it ran
    SUPERSEDED = "superseded"        # dispatched again elsewhere (fencing): this run must stop
    BAD_CONSTRAINT = "bad_constraint"  # its grammar does not compile here, or rejects its prior tokens


# Finish reasons reuse the public enum so events need no translation.
FINISH_STOP = inference_pb2.FINISH_REASON_STOP
FINISH_LENGTH = inference_pb2.FINISH_REASON_LENGTH
FINISH_CANCELLED = inference_pb2.FINISH_REASON_CANCELLED


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, every default already resolved."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 = off
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False       # benchmarks: run to max_new_tokens
    grammar: str = ""              # llguidance grammar the output must match ("" = free text)
    logprobs: bool = False         # record each sampled token's log probability (sampler.py)
    top_logprobs: int = 0          # ... and the this many most likely tokens at its position

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log probabilities at one sampled position (sampler.py says of which distribution)."""

    logprob: float                            # of the token sampled there
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob) of the most likely, best first


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    Args:
        prompt_token_ids: the prompt.
        params: sampling parameters.
        prior_output_ids: tokens already generated (handoff); they count toward max_new_tokens.
        request_id: caller's id, carried through for events.
        cache_salt: prefix-cache salt (the work item's); blocks are shared only under the same salt.
        priority: the work item's Priority (HIGH preempts lower running sequences; scheduler.py).
        slo: latency targets; with arrival_unix_ms they give the next token's deadline (llmserve/protocol/slo.py).
        tenant, tenant_weight: whose request it is and that tenant's share (token-fair admission).
        choice_index: which of the request's n choices this sequence generates.
        leader: choice 0 of the same request; this sequence is scheduled only once the leader's
            prompt is computed, so it finds that prompt's blocks in the prefix cache.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    prior_output_ids: list[int] = field(default_factory=list)
    request_id: str = ""
    cache_salt: str = ""
    priority: int = inference_pb2.PRIORITY_NORMAL
    slo: Targets = Targets()
    arrival_unix_ms: int = 0
    tenant: str = ""
    tenant_weight: float = 1.0
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0   # prompt tokens served from the prefix cache at first admission
    admitted: bool = False
    finish_reason: int = 0              # FinishReason; 0 = not finished
    failure: Failure | None = None      # why the sequence failed (None: it did not)
    waited_steps: int = 0               # scheduler steps spent waiting, over all its waits (aging)
    matcher: Any = None                 # llguidance.LLMatcher of params.grammar (engine/constraint.py)
    choice_index: int = 0
    leader: Sequence | None = None
    # with params.logprobs: one per output_token_ids entry; `sampled` is the sampler's latest
    # draw, taken by append_token (a stop token is sampled but never appended)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    sampled: TokenLogprobs | None = None
    # tokens guessed to follow the context, computed by the next step with it and kept only where
    # they equal what is sampled there (engine/speculation.py); never part of token_ids
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = [*self.prompt_token_ids, *self.prior_output_ids]

    # --- sizes -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens of the completion so far, including those produced before a handoff."""
        return len(self.prior_output_ids) + len(self.output_token_ids)

    @property
    def index_offset(self) -> int:
        """Completion index of output_token_ids[0]."""
        return len(self.prior_output_ids)

    @property
    def num_tokens_with_draft(self) -> int:
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Positions the next step may compute: the rest of the context, then the draft."""
        return self.num_tokens_with_draft - self.num_computed_tokens

    def tokens_in(self, start: int, end: int) -> list[int]:
        """The token ids at positions [start, end), the draft continuing the context."""
        tokens = self.token_ids[start:end]
        if end > self.num_tokens:
            tokens += self.draft_token_ids[max(0, start - self.num_tokens):end - self.num_tokens]
        return tokens

    @property
    def deadline_ms(self) -> float:
        """When the next token is due (unix ms); infinite without a TTFT target."""
        return next_token_deadline_ms(self.arrival_unix_ms, self.slo, self.num_generated)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # --- transitions -------------------------------------------------------------------------
    @property
    def waits_for_leader(self) -> bool:
        """The leader still computes the shared prompt (it is neither past it nor finished)."""
        leader = self.leader
        return leader is not None and not leader.is_finished and \
            leader.num_computed_tokens < leader.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.sampled is not None:
            self.output_logprobs.append(self.sampled)
            self.sampled = None

    def finish(self, reason: int, failure: Failure | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.failure = failure

    def reset_for_recompute(self) -> None:
        """Preempted: KV is dropped, every token (prompt and output) is recomputed later."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.draft_token_ids = []
