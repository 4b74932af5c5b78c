"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Every step:

    0. the waiting queue is put in rank order (higher level first; within a level, sequences
       that waited the full aging bound oldest first, then earliest next-token deadline first,
       then the least-served tenant's first, then older first);
       while its head cannot be admitted for want of slots or KV blocks, it preempts the
       running sequences below its level (or of its level and younger), lowest level and most
       recently started first,
       as few as make it fit (none if even all of them would not), and is admitted at once;
    1. running sequences, oldest first, each takes min(uncomputed tokens, budget left):
       one token for a decode, a chunk for a long prefill (chunked prefill);
       when the KV cache is full the lowest-level, newest running sequence is preempted;
    2. waiting sequences are admitted in order while slots, token budget and blocks last
       (nothing is admitted in a step that had to preempt for KV room).

Preemption is recompute: blocks are freed, output so far is kept, the sequence waits again.

A sequence's level is its priority (LOW 1, NORMAL 2, HIGH 3; unspecified is NORMAL) plus one
per `aging_steps` steps it has spent waiting, over all its waits, capped at HIGH (the starvation
guard). Once a sequence has waited 2 * aging_steps steps it is at HIGH and ranks above every
sequence that has not (deadlines aside), oldest first among those that have: no later arrival can
pass it in the queue or preempt it, and it preempts younger running sequences itself. So with
nothing older ahead of it, a LOW sequence waits at most 2 * aging_steps + 1 steps.

Deadlines (SLO targets, llmserve/protocol/slo.py) order the queue within a level only; they never make
one sequence preempt another of its level.

Tenants share the worker by tokens (VTC, as the batcher's fair queue does): every token a step
computes for a sequence (prefill chunk or decode) adds 1 / tenant_weight to its tenant's
counter, and a tenant that (re)joins starts at the least counter of the active tenants. With
`fair_tokens` off each admission counts 1 / weight instead (request round-robin, a baseline).

Sequences that finish, are cancelled or expire leave through `finish()` at once and free
their blocks. Policy lives here; block bookkeeping in `BlockManager`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.sequence import Sequence, SequenceStatus
from llmserve.v1 import inference_pb2

_PRIORITIES = (inference_pb2.PRIORITY_LOW, inference_pb2.PRIORITY_NORMAL, inference_pb2.PRIORITY_HIGH)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32               # running sequences at most
    max_num_batched_tokens: int = 512    # tokens in one forward (decodes + prefill chunks)
    priority_preemption: bool = True     # step 0: a higher-ranked waiting sequence evicts running ones
    aging_steps: int = 256               # waited steps per level gained (LOW waits <= 2x this + 1)
    fair_tokens: bool = True             # tenants share by tokens computed; False: by admissions (round-robin)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int                      # query length this step

    @property
    def completes_context(self) -> bool:
        """After this step every token of the context is computed, so the step's logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens >= self.seq.num_tokens

    @property
    def num_logits(self) -> int:
        """Logits rows the step gives this sequence: one a position when it verifies a draft
        (engine/speculation.py), else its last token's."""
        return self.num_tokens if self.seq.draft_token_ids else 1


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_memory: list[Sequence] = field(default_factory=list)   # cannot fit even alone
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting queue, running batch, and the per-step plan.

    Args:
        config: batch limits.
        block_manager: KV block bookkeeping the scheduler asks for room.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.served: dict[str, float] = {}     # tenant → virtual tokens computed (token fairness)

    def add(self, seq: Sequence) -> None:
        self._lift(seq.tenant)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _lift(self, tenant: str) -> None:
        """A tenant with nothing here starts at the least counter of the active ones: idling banks no credit."""
        active = {s.tenant for s in (*self.waiting, *self.running)}
        if tenant in active:
            return
        floor = min((self.served.get(t, 0.0) for t in active), default=self.served.get(tenant, 0.0))
        self.served[tenant] = max(self.served.get(tenant, 0.0), floor)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take a finished/cancelled/expired sequence out and free its blocks now."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._order_waiting()
        budget, admitted = self._preempt_for_priority(out, self.config.max_num_batched_tokens)
        evicted = len(out.preempted)
        budget = self._schedule_running(out, budget, [s for s in self.running if s not in admitted])
        if len(out.preempted) == evicted:
            self._order_waiting()
            self._admit_waiting(out, budget)
        for seq in self.waiting:
            seq.waited_steps += 1
        if self.config.fair_tokens:
            for item in out.scheduled:
                self._charge(item.seq, item.num_tokens)
        return out

    def _charge(self, seq: Sequence, cost: float) -> None:
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + cost / (seq.tenant_weight or 1.0)

    # --- rank --------------------------------------------------------------------------------
    def level(self, seq: Sequence) -> int:
        """Priority plus one per `aging_steps` steps waited, at most HIGH."""
        base = seq.priority if seq.priority in _PRIORITIES else inference_pb2.PRIORITY_NORMAL
        return min(_PRIORITIES[-1], base + seq.waited_steps // self.config.aging_steps)

    def aged(self, seq: Sequence) -> bool:
        """Waited the whole aging bound: it ranks by age alone, ahead of every deadline."""
        return seq.waited_steps >= 2 * self.config.aging_steps

    def _rank(self, seq: Sequence) -> tuple[int, int]:
        """Who may preempt whom: level, then age (sequence ids grow with creation)."""
        return self.level(seq), -seq.seq_id

    def _queue_rank(self, seq: Sequence) -> tuple[int, bool, float, float, int]:
        """Higher is served first: level, aged, earliest deadline, least-served tenant, then age
        (an aged sequence ranks by age alone)."""
        if self.aged(seq):
            return self.level(seq), True, 0.0, 0.0, -seq.seq_id
        return self.level(seq), False, -seq.deadline_ms, -self.served.get(seq.tenant, 0.0), -seq.seq_id

    def _order_waiting(self) -> None:
        self.waiting = deque(sorted(self.waiting, key=self._queue_rank, reverse=True))

    def _victims(self, candidates: list[Sequence]) -> list[Sequence]:
        """`candidates` (in start order) in the order they are preempted: lowest level, newest first."""
        newest_first = candidates[::-1]
        return sorted(newest_first, key=self.level)

    def preemptible_by_high(self) -> tuple[int, int]:
        """(running sequences below HIGH, the KV blocks they alone hold): the room a HIGH arrival
        could make by preemption; (0, 0) with priority preemption off."""
        if not self.config.priority_preemption:
            return 0, 0
        below = [s for s in self.running if self.level(s) < _PRIORITIES[-1]]
        return len(below), sum(self.blocks.num_exclusive_blocks(s) for s in below)

    # --- step 0: priority preemption ---------------------------------------------------------
    def _preempt_for_priority(self, out: SchedulerOutput, budget: int) -> tuple[int, list[Sequence]]:
        admitted: list[Sequence] = []
        while self.config.priority_preemption and self.waiting and budget > 0:
            head = self.waiting[0]
            victims = self._victims_for(head)
            if not victims:
                break
            for victim in victims:
                self._preempt(victim, out)
            self.waiting.remove(head)
            budget = self._admit(head, out, budget)
            admitted.append(head)
        return budget, admitted

    def _victims_for(self, head: Sequence) -> list[Sequence]:
        """The fewest lower-ranked running sequences whose preemption admits `head`; [] when it
        fits already or cannot be made to fit."""
        slots_short = len(self.running) - self.config.max_num_seqs + 1
        blocks_short = 0 if self.blocks.can_allocate(head) else (
            self.blocks.blocks_needed(head.num_tokens) - self.blocks.num_free_blocks)
        if slots_short <= 0 and blocks_short <= 0:
            return []
        rank = self._rank(head)
        chosen: list[Sequence] = []
        for victim in self._victims([s for s in self.running if self._rank(s) < rank]):
            chosen.append(victim)
            blocks_short -= self.blocks.num_exclusive_blocks(victim)
            if len(chosen) >= slots_short and blocks_short <= 0:
                return chosen
        return []

    # --- running -----------------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int, queue: list[Sequence]) -> int:
        while queue and budget > 0:
            seq = queue.pop(0)
            if not self._make_room(seq, queue, out):
                continue
            append = self.blocks.append_slot(seq)
            out.copy_on_write.extend(append.copy_on_write)
            num = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, num))
            budget -= num
        return budget

    # --- drafts --------------------------------------------------------------------------------
    def add_drafts(self, out: SchedulerOutput, drafts: list[tuple[Sequence, list[int]]]) -> None:
        """Extend planned decodes by their drafts (engine/speculation.py) with what the plan left: token
        budget and free blocks after every running and admitted sequence had its share, so a draft
        never preempts, delays or crowds out anyone. A draft that does not fit is cut or dropped."""
        budget = self.config.max_num_batched_tokens - out.num_tokens
        items = {id(item.seq): i for i, item in enumerate(out.scheduled)}
        for seq, draft in drafts:
            i = items.get(id(seq))
            if i is None or budget <= 0 or out.scheduled[i].num_tokens != seq.num_uncomputed:
                continue
            seq.draft_token_ids = draft[:budget]
            if not self.blocks.can_append(seq):
                seq.draft_token_ids = []
                continue
            out.copy_on_write.extend(self.blocks.append_slot(seq).copy_on_write)
            out.scheduled[i] = ScheduledSeq(seq, seq.num_uncomputed)
            budget -= len(seq.draft_token_ids)
            if self.config.fair_tokens:
                self._charge(seq, len(seq.draft_token_ids))

    def _make_room(self, seq: Sequence, queue: list[Sequence], out: SchedulerOutput) -> bool:
        """Preempt the lowest, newest running sequences until `seq` can grow; False if `seq` itself went."""
        while not self.blocks.can_append(seq):
            if len(self.running) == 1:          # alone and still no room: it can never fit
                self.running.remove(seq)
                self.blocks.free(seq)
                out.out_of_memory.append(seq)
                return False
            victim = self._victims([seq, *queue])[0]
            self._preempt(victim, out)
            if victim is seq:
                return False
            queue.remove(victim)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    # --- waiting -----------------------------------------------------------------------------
    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq in out.preempted:             # evicted this step: it does not come back in it
                break
            if not self.blocks.can_allocate(seq):
                if not self.running and not out.scheduled:
                    self.waiting.popleft()       # bigger than the whole cache
                    out.out_of_memory.append(seq)
                    continue
                break
            self.waiting.popleft()
            budget = self._admit(seq, out, budget)

    def _admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        allocation = self.blocks.allocate(seq)
        seq.num_computed_tokens = allocation.num_cached_tokens
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_prompt_tokens = min(allocation.num_cached_tokens, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if not self.config.fair_tokens:
            self._charge(seq, 1.0)              # request round-robin: one per (re)admission
        num = min(seq.num_uncomputed, budget)
        out.scheduled.append(ScheduledSeq(seq, num))
        return budget - num
