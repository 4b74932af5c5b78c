"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Every step:

    1. running sequences, oldest first, each takes min(uncomputed tokens, budget left):
       one token for a decode, a chunk for a long prefill (chunked prefill);
       when the KV cache is full the newest running sequence is preempted (recompute):
       its blocks are freed and it goes back to the head of the waiting queue;
    2. waiting sequences are admitted in order while slots, token budget and blocks last
       (nothing is admitted in a step that had to preempt).

Sequences that finish, are cancelled or expire leave through `finish()` at once and free
their blocks. Policy lives here; block bookkeeping in `BlockManager`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32               # running sequences at most
    max_num_batched_tokens: int = 512    # tokens in one forward (decodes + prefill chunks)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int                      # query length this step

    @property
    def completes_context(self) -> bool:
        """After this step every token is computed, so the step's logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


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

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

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
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    # --- running -----------------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            if not self._make_room(seq, queue, out):
                continue
            append = self.blocks.append_slot(seq)
            if append.copy_on_write:
                out.copy_on_write.append(append.copy_on_write)
            num = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, num))
            budget -= num
        return budget

    def _make_room(self, seq: Sequence, queue: list[Sequence], out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can grow; False if `seq` itself went."""
        while not self.blocks.can_append(seq):
            if queue:
                self._preempt(queue.pop(), out)
                continue
            if len(self.running) == 1:          # alone and still no room: it can never fit
                self.running.remove(seq)
                self.blocks.free(seq)
                out.out_of_memory.append(seq)
            else:
                self._preempt(seq, out)
            return False
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
            if not self.blocks.can_allocate(seq):
                if not self.running and not out.scheduled:
                    self.waiting.popleft()       # bigger than the whole cache
                    out.out_of_memory.append(seq)
                    continue
                break
            self.waiting.popleft()
            allocation = self.blocks.allocate(seq)
            seq.num_computed_tokens = allocation.num_cached_tokens
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_prompt_tokens = min(allocation.num_cached_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, num))
            budget -= num
