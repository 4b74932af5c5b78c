"""Paged KV-cache bookkeeping: which physical block holds which tokens of which sequence.

The block manager owns ids only, never tensors. The scheduler asks it
`can_allocate / allocate / can_append / append_slot / free` and gets result objects.

Block states:

    free list (no content)  ──take──▶  in use (ref_count ≥ 1) ──last free──▶ free list
            ▲                             │      ▲                        (block never got a hash)
            │ evict (LRU head)            │      │ prefix hit
            └──────── evictable LRU ◀─────┘──────┘
                     (ref_count 0, hash kept: its KV can still be reused)

Automatic prefix caching: once a full block's KV is computed it is registered under its
chain hash (`llmserve/prefix_hash.py`); a later sequence whose context starts with the same blocks
under the same cache salt (tenant or cache_group) takes them instead of recomputing. Unreferenced
cached blocks are evicted least recently used first, and a sequence frees its blocks tail-first so
its tail is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from gpu_worker.engine.sequence import Sequence
from llmserve.prefix_hash import DISPATCH_PREFIX_BLOCKS, block_hashes, root_hash

_RECENTLY_USED_KEPT = 4096  # hashes remembered for `cached_hashes`


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None   # set once the block is full, computed and registered


@dataclass(frozen=True)
class Allocation:
    """Blocks given to a sequence on admission."""

    block_ids: list[int]
    num_cached_tokens: int          # leading tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class AppendResult:
    """Outcome of making room for the next token(s)."""

    new_block_ids: list[int] = field(default_factory=list)
    copy_on_write: tuple[int, int] | None = None   # (src, dst): copy KV of src into dst before the step


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Free list, reference counts, block tables and the prefix cache.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse computed full blocks across sequences.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # oldest first
        self._hash_to_block: dict[int, int] = {}
        self._recently_used: OrderedDict[int, None] = OrderedDict()   # block hashes, least recent first
        self._tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[int]] = {}    # chain hashes of each sequence's computed full blocks
        self.stats = PrefixCacheStats()

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables[seq.seq_id]

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def num_exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks only `seq` holds: what `free(seq)` gives back to the free count."""
        return sum(1 for b in self._tables.get(seq.seq_id, []) if self.blocks[b].ref_count == 1)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_hashes(self, limit: int) -> list[int]:
        """Hashes of cached leading blocks (the first DISPATCH_PREFIX_BLOCKS of a context), most
        recently registered or hit first: what the heartbeat advertises for prefix-aware dispatch.
        A prefix's first block is the most recent of its run, so a hot shared prefix stays listed."""
        out: list[int] = []
        for block_hash in reversed(self._recently_used):
            if len(out) == limit:
                break
            if block_hash in self._hash_to_block:
                out.append(block_hash)
        return out

    def _touch(self, chain: list[int]) -> None:
        """Mark the leading blocks of a context's hash chain as just used."""
        for block_hash in reversed(chain[:DISPATCH_PREFIX_BLOCKS]):
            self._recently_used[block_hash] = None
            self._recently_used.move_to_end(block_hash)
        while len(self._recently_used) > _RECENTLY_USED_KEPT:
            self._recently_used.popitem(last=False)

    # --- admission -------------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """(block ids, hashes) of the cached leading full blocks of the context.

        At least one token is left uncached: the step must compute it to get logits.
        """
        if not self.enable_prefix_caching:
            return [], []
        usable = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        hashes = block_hashes(seq.token_ids[:usable * self.block_size], self.block_size, seq.cache_salt)
        for block_hash in hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, hashes[:len(hits)]

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether blocks for the whole current context of `seq` are available."""
        hits, _ = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> Allocation:
        """Give `seq` blocks for its whole context, reusing cached prefix blocks."""
        assert seq.seq_id not in self._tables, f"sequence {seq.seq_id} already has blocks"
        assert self.can_allocate(seq), "allocate() without can_allocate()"
        hits, hashes = self._prefix_hits(seq)
        for block_id in hits:
            self._acquire(block_id)
        self._touch(hashes)
        fresh = [self._take_free() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        self._tables[seq.seq_id] = [*hits, *fresh]
        self._hashes[seq.seq_id] = hashes
        cached = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += cached
        return Allocation(list(self._tables[seq.seq_id]), cached)

    # --- growth ----------------------------------------------------------------------------
    def _cow_needed(self, seq: Sequence) -> bool:
        """The block the next token is written into is shared with another sequence."""
        table = self._tables[seq.seq_id]
        index = seq.num_computed_tokens // self.block_size
        return index < len(table) and self.blocks[table[index]].ref_count > 1

    def can_append(self, seq: Sequence) -> bool:
        table = self._tables[seq.seq_id]
        needed = self.blocks_needed(seq.num_tokens) - len(table) + int(self._cow_needed(seq))
        return needed <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> AppendResult:
        """Make room for every uncomputed token of `seq` (normally the one just sampled)."""
        assert self.can_append(seq), "append_slot() without can_append()"
        table = self._tables[seq.seq_id]
        cow = None
        if self._cow_needed(seq):
            index = seq.num_computed_tokens // self.block_size
            src, dst = table[index], self._take_free()
            self._release(src)
            table[index] = dst
            cow = (src, dst)
        new = [self._take_free() for _ in range(self.blocks_needed(seq.num_tokens) - len(table))]
        table.extend(new)
        return AppendResult(new, cow)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (e.g. parallel samples of one prompt)."""
        assert child.seq_id not in self._tables
        table = self._tables[parent.seq_id]
        for block_id in table:
            self._acquire(block_id)
        self._tables[child.seq_id] = list(table)
        self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])
        child.num_computed_tokens = parent.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes[seq.seq_id]
        table = self._tables[seq.seq_id]
        parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
        tokens = seq.token_ids[:seq.num_computed_tokens]
        known = len(hashes)
        for block_hash in block_hashes(tokens, self.block_size, start=len(hashes), parent=parent):
            block = self.blocks[table[len(hashes)]]
            if block_hash not in self._hash_to_block and block.block_hash is None:
                block.block_hash = block_hash
                self._hash_to_block[block_hash] = block.block_id
            hashes.append(block_hash)
        if known < min(len(hashes), DISPATCH_PREFIX_BLOCKS):
            self._touch(hashes)

    # --- release ---------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks (tail first, so the tail is evicted before the head)."""
        table = self._tables.pop(seq.seq_id, [])
        self._hashes.pop(seq.seq_id, None)
        for block_id in reversed(table):
            self._release(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds."""
        while self._evictable:
            self._free.append(self._evict())

    # --- internals -------------------------------------------------------------------------
    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    def _evict(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block = self.blocks[block_id]
        del self._hash_to_block[block.block_hash]
        block.block_hash = None
        return block_id

    def _take_free(self) -> int:
        block_id = self._free.popleft() if self._free else self._evict()
        self.blocks[block_id].ref_count = 1
        return block_id
