"""One batch's budget while it is being taken from the queue: sequences, prompt tokens, KV blocks."""

from __future__ import annotations

from batcher.config import BatchLimits
from batcher.events import DropReason
from batcher.fair_queue import Held
from batcher.workers import Capacity, blocks_needed
from llmserve.protocol.queue import is_expired
from llmserve.v1 import inference_pb2


class BatchBudget:
    """What one batch for one worker may still take: sequences, prompt tokens, KV blocks."""

    def __init__(self, limits: BatchLimits, decode_reserve: float, cap: Capacity, largest_total: int,
                 stamp_ms: int) -> None:
        self.limits, self.decode_reserve, self.cap = limits, decode_reserve, cap
        self.seqs = min(limits.max_batch, cap.free_seqs)
        self.tokens = 0
        self.blocks = cap.free_blocks
        # HIGH items may also take what they can preempt (batcher/workers.py Capacity.room)
        self.preempt_seqs, self.preempt_blocks = cap.preemptible_seqs, cap.preemptible_blocks
        self.largest_total = largest_total   # of any accepting worker: more than that never fits
        self.now_ms = stamp_ms
        self.drops: dict[Held, tuple[Held, DropReason, str]] = {}
        self.reserved_blocks = 0

    def admit(self, held: Held) -> bool:
        """True: taken (into the batch, or into `drops`); False: does not fit, its tenant sits this batch out."""
        if is_expired(held.item, self.now_ms):
            self.drops[held] = (held, DropReason.DEADLINE, "")
            return True
        need = blocks_needed(held.item, self.cap.block_size, self.decode_reserve)
        if self.largest_total and need > self.largest_total:
            self.drops[held] = (held, DropReason.TOO_LARGE, f"needs {need} blocks, largest worker has "
                                                           f"{self.largest_total}")
            return True
        high = held.item.priority == inference_pb2.PRIORITY_HIGH
        seqs = self.seqs + (self.preempt_seqs if high else 0)
        blocks = max(0, self.blocks) + (self.preempt_blocks if high else 0)
        if seqs <= 0 or need > blocks:
            return False
        first = self.tokens == 0
        if not first and self.tokens + held.prompt_tokens > self.limits.prefill_token_budget:
            return False
        self._take(need, high)
        self.reserved_blocks += need
        self.tokens += held.prompt_tokens
        return True

    def _take(self, need: int, high: bool) -> None:
        """Spend free room first; a HIGH item spends preemptible room for the rest."""
        from_free = min(need, max(0, self.blocks)) if high else need
        self.blocks -= from_free
        self.preempt_blocks -= need - from_free
        if self.seqs > 0 or not high:
            self.seqs -= 1
        else:
            self.preempt_seqs -= 1
