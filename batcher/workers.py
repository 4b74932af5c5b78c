"""Worker capacity as the batcher sees it: heartbeats minus what it sent since.

A heartbeat says how many KV blocks and sequence slots a worker had free when
it was sent. Between heartbeats the batcher keeps a local ledger of what it
dispatched to each worker, so it never sends more than the worker can admit:

    free = heartbeat.free_blocks - sum(blocks of batches sent after heartbeat - grace)

A reservation is dropped once a heartbeat at least `grace_ms` newer than the
dispatch arrives (by then the worker has read its inbox and counts the batch
itself). Each replica keeps its own ledger, so two replicas may both fill the
same free space within one heartbeat interval.

Prefix-aware choice: a heartbeat also lists the chain hashes of the worker's most
recently used cached KV blocks (`llmserve/protocol/prefix_hash.py`). A batch goes to the
worker that already holds the longest run of its first item's leading blocks,
provided that item fits there and the worker is not much busier than the others;
otherwise to the one with the most free blocks.

Priority: a HIGH item that fits no worker's free room goes to a full worker where
preemption makes room for it (its heartbeat's preemptible sequences and their blocks),
the one that must preempt least: the most free blocks, then the most preemptible room.
The worker's scheduler then takes the slot of its lowest, newest running sequence at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmserve.protocol.prefix_hash import DISPATCH_PREFIX_BLOCKS, block_hashes
from llmserve.v1 import inference_pb2, queue_pb2

# When a worker does not report max_running, sequence slots are not the limit.
_UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Capacity:
    worker_id: str
    free_blocks: int
    free_seqs: int
    block_size: int
    total_blocks: int
    cached_prefix: frozenset[int] = frozenset()   # chain hashes of recently used cached blocks
    preemptible_seqs: int = 0      # running below HIGH: room a HIGH item can take by preemption
    preemptible_blocks: int = 0

    def room(self, priority: int) -> tuple[int, int]:
        """(sequence slots, KV blocks) an item of `priority` may take here: HIGH adds what it can preempt."""
        if priority != inference_pb2.PRIORITY_HIGH:
            return self.free_seqs, self.free_blocks
        return max(0, self.free_seqs) + self.preemptible_seqs, max(0, self.free_blocks) + self.preemptible_blocks


@dataclass
class _Reservation:
    sent_unix_ms: int
    blocks: int
    seqs: int


@dataclass
class _Worker:
    heartbeat: queue_pb2.WorkerHeartbeat
    reservations: list[_Reservation] = field(default_factory=list)
    reserved_blocks: int = 0   # running sums of `reservations`
    reserved_seqs: int = 0

    def add(self, reservation: _Reservation) -> None:
        self.reservations.append(reservation)
        self.reserved_blocks += reservation.blocks
        self.reserved_seqs += reservation.seqs


def blocks_needed(item: queue_pb2.WorkItem, block_size: int, decode_reserve: float) -> int:
    """KV blocks an item needs at admission: its context plus a share of max_new_tokens."""
    if block_size <= 0:
        return 0
    context = len(item.prompt_token_ids) + len(item.generated_token_ids)
    choices = len(item.choices) or max(1, item.n)     # n choices share the prompt's blocks, decode apart
    decode = math.ceil(item.sampling.max_new_tokens * decode_reserve) * choices
    return math.ceil((context + decode) / block_size)


def leading_hashes(item: queue_pb2.WorkItem, block_size: int) -> list[int]:
    """Chain hashes of the item's first DISPATCH_PREFIX_BLOCKS full blocks (prompt, then generated),
    under the item's cache salt, as its worker's block manager will hash them."""
    if block_size <= 0:
        return []
    context = [*item.prompt_token_ids, *item.generated_token_ids][:DISPATCH_PREFIX_BLOCKS * block_size]
    return block_hashes(context, block_size, item.cache_salt)


def cached_run(hashes: list[int], cap: Capacity) -> int:
    """How many of these leading block hashes, from the first on, the worker says it has cached."""
    run = 0
    for block_hash in hashes:
        if block_hash not in cap.cached_prefix:
            break
        run += 1
    return run


class WorkerPool:
    """Live workers of one model and their remaining capacity.

    Args:
        heartbeat_ttl_ms: a heartbeat older than this marks the worker silent.
        grace_ms: see the module docstring.
    """

    def __init__(self, heartbeat_ttl_ms: int, grace_ms: int) -> None:
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self.grace_ms = grace_ms
        self._workers: dict[str, _Worker] = {}

    def update(self, heartbeats: dict[str, queue_pb2.WorkerHeartbeat]) -> None:
        """Replace the view with freshly read heartbeats; keep still-open reservations."""
        workers = {}
        for worker_id, hb in heartbeats.items():
            known = self._workers.get(worker_id)
            reservations = known.reservations if known else []
            cutoff = hb.sent_unix_ms - self.grace_ms
            workers[worker_id] = worker = _Worker(hb)
            for reservation in reservations:
                if reservation.sent_unix_ms > cutoff:
                    worker.add(reservation)
        self._workers = workers

    def is_alive(self, worker_id: str, now_ms: int) -> bool:
        """Recent heartbeat (draining or not): its inbox is being served."""
        worker = self._workers.get(worker_id)
        return worker is not None and now_ms - worker.heartbeat.sent_unix_ms <= self.heartbeat_ttl_ms

    def accepting(self, now_ms: int) -> list[Capacity]:
        """Workers that may get new batches (alive, not draining), most free blocks first."""
        caps = [self._capacity(wid, w) for wid, w in self._workers.items()
                if self.is_alive(wid, now_ms) and not w.heartbeat.draining]
        return sorted(caps, key=lambda c: (-c.free_blocks, -c.free_seqs, c.worker_id))

    def choose(self, head: queue_pb2.WorkItem | None, now_ms: int, decode_reserve: float) -> Capacity | None:
        """The worker for a batch that starts with `head` (None: no preference), among those with
        room for at least one sequence: one where `head` fits, that has at least half the free
        sequence slots of the least busy worker (so a hot prefix does not pile work onto one
        worker), and that caches the longest run of `head`'s leading blocks; ties (and no prefix
        anywhere) go to the most free blocks."""
        accepting = self.accepting(now_ms)
        open_workers = [c for c in accepting if c.free_seqs > 0 and c.free_blocks > 0]
        if head is not None and head.priority == inference_pb2.PRIORITY_HIGH and not any(
                blocks_needed(head, c.block_size, decode_reserve) <= c.free_blocks for c in open_workers):
            return self._preempting(head, accepting, decode_reserve) or next(iter(open_workers), None)
        if head is None or len(open_workers) < 2:
            return next(iter(open_workers), None)
        most_slots = max(c.free_seqs for c in open_workers)
        hashes: dict[int, list[int]] = {}   # by block size: computed once, not once per worker

        def score(cap: Capacity) -> int:
            if not cap.cached_prefix or 2 * cap.free_seqs < most_slots or \
                    blocks_needed(head, cap.block_size, decode_reserve) > cap.free_blocks:
                return 0
            if cap.block_size not in hashes:
                hashes[cap.block_size] = leading_hashes(head, cap.block_size)
            return cached_run(hashes[cap.block_size], cap)

        return max(open_workers, key=score)   # the first of equals: most free blocks

    @staticmethod
    def _preempting(head: queue_pb2.WorkItem, accepting: list[Capacity], decode_reserve: float) -> Capacity | None:
        """The full worker where preemption admits the HIGH `head` and evicts least (most free
        blocks, then most preemptible room); None when preemption makes room nowhere."""
        def fits(cap: Capacity) -> bool:
            slots, blocks = cap.room(inference_pb2.PRIORITY_HIGH)
            return slots > 0 and blocks_needed(head, cap.block_size, decode_reserve) <= blocks

        candidates = [c for c in accepting if c.preemptible_seqs > 0 and fits(c)]
        return max(candidates, key=lambda c: (c.free_blocks, c.preemptible_blocks), default=None)

    def reserve(self, worker_id: str, blocks: int, seqs: int, now_ms: int) -> None:
        self._workers[worker_id].add(_Reservation(now_ms, blocks, seqs))

    def _capacity(self, worker_id: str, worker: _Worker) -> Capacity:
        hb = worker.heartbeat
        slots = hb.max_running - hb.running - hb.waiting if hb.max_running else _UNBOUNDED
        return Capacity(worker_id, hb.free_blocks - worker.reserved_blocks, slots - worker.reserved_seqs,
                        hb.block_size, hb.total_blocks, frozenset(hb.cached_prefix_hashes),
                        hb.preemptible_seqs, hb.preemptible_blocks)
