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
chain hash (`llmserve/protocol/prefix_hash.py`); a later sequence whose context starts with the same blocks
under the same cache salt (tenant or cache_group) takes them instead of recomputing. Unreferenced
cached blocks are evicted least recently used first, and a sequence frees its blocks tail-first so
its tail is evicted before its head.

KV groups (gpu_worker/model/kv_cache.py KVLayout): each sequence has one block table per group,
all drawn from one pool. A sliding-window group gives back, after each step, the blocks that lie
wholly before the window of the next token (vLLM's SlidingWindowManager.remove_skipped_blocks):

    window 8, block 4, 14 tokens computed: the next token (position 14) sees keys 7 .. 14
      full group     b0 b1 b2 b3
      window group   -- b5 b6 b7        block 0 (tokens 0-3) released, entry NULL

and takes blocks only for the tokens one step can compute (`max_step_tokens`, the scheduler's token
budget), not for the whole context: a prompt longer than the window is prefilled chunk by chunk with
at most window + one chunk of blocks in a window group, freed behind as the chunks advance:

    window 6, block 4, step budget 8, a 20-token prompt
      admitted      full  b0 b1 b2 b3 b4    window  b5 b6              (tokens 0-7)
      after 8       full  b0 b1 b2 b3 b4    window  b5 b6 b7 b8        (next chunk 8-15)
      after 16      full  b0 b1 b2 b3 b4    window  -- -- b7 b8 b9     (16 sees 11 ..: 0-7 given back)

A released block keeps its hash (evictable, like any freed block), so a later prompt with the same
prefix can still hit it. A prefix hit of n blocks needs the first n blocks in every full group and,
in a window group, only the blocks the window of token n * block_size reaches.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from gpu_worker.engine.sequence import Sequence
from llmserve.protocol.prefix_hash import DISPATCH_PREFIX_BLOCKS, block_hashes, root_hash

_RECENTLY_USED_KEPT = 4096  # hashes remembered for `cached_hashes`
NULL = -1                   # a window group's table entry whose block was given back


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: tuple[int, int] | None = None   # (group, chain hash), set once full, computed and registered


@dataclass(frozen=True)
class Allocation:
    """Blocks given to a sequence on admission."""

    block_ids: list[int]
    num_cached_tokens: int          # leading tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class AppendResult:
    """Outcome of making room for the next token(s)."""

    new_block_ids: list[int] = field(default_factory=list)
    # (src, dst) per group whose written block was shared: copy KV of src into dst before the step
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Free list, reference counts, block tables (one per KV group) and the prefix cache.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse computed full blocks across sequences.
        windows: per KV group, its sliding window (None: full attention); KVLayout.windows.
        max_step_tokens: the most tokens one step computes for a sequence (the scheduler's token
            budget): a window group holds blocks only that far past the computed tokens. None: every
            group takes blocks for the whole context.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,), max_step_tokens: int | None = None) -> None:
        assert num_blocks > 0 and block_size > 0 and windows
        assert max_step_tokens is None or max_step_tokens > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows
        self.max_step_tokens = max_step_tokens
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # oldest first
        self._key_to_block: dict[tuple[int, int], int] = {}
        self._recently_used: OrderedDict[int, None] = OrderedDict()   # block hashes, least recent first
        self._tables: dict[int, list[list[int]]] = {}   # per sequence, per group
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

    def block_table(self, seq: Sequence, group: int = 0) -> list[int]:
        """`seq`'s blocks in `group` by position; a given-back entry reads as block 0 (the window masks it)."""
        return [max(b, 0) for b in self._tables[seq.seq_id][group]]

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def num_held_blocks(self, seq: Sequence, group: int = 0) -> int:
        """Blocks `seq` holds in `group` (given-back entries not counted)."""
        return sum(1 for b in self._tables[seq.seq_id][group] if b != NULL)

    def num_exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks only `seq` holds: what `free(seq)` gives back to the free count."""
        return sum(1 for b in self._held(seq) if self.blocks[b].ref_count == 1)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a context of `num_tokens` takes when admitted with no prefix hit (every group)."""
        return sum(self._table_end(group, 0, num_tokens) for group in range(len(self.windows)))

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _table_end(self, group: int, num_computed: int, num_tokens: int) -> int:
        """How many entries `group`'s table needs for the next step from `num_computed` of `num_tokens`:
        all of the context in a full group, only what one step can reach in a window group."""
        if self.windows[group] is None or self.max_step_tokens is None:
            return self._blocks_for(num_tokens)
        return self._blocks_for(min(num_tokens, num_computed + self.max_step_tokens))

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block of `group` the token at position `num_computed` attends to."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _held(self, seq: Sequence) -> list[int]:
        return [b for table in self._tables.get(seq.seq_id, []) for b in table if b != NULL]

    def cached_hashes(self, limit: int) -> list[int]:
        """Hashes of cached leading blocks (the first DISPATCH_PREFIX_BLOCKS of a context), most
        recently registered or hit first: what the heartbeat advertises for prefix-aware dispatch.
        A prefix's first block is the most recent of its run, so a hot shared prefix stays listed."""
        out: list[int] = []
        for block_hash in reversed(self._recently_used):
            if len(out) == limit:
                break
            if (0, block_hash) in self._key_to_block:
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
    def _prefix_hits(self, seq: Sequence) -> tuple[int, list[int]]:
        """(n, hashes of the first n blocks): the longest cached prefix of n full blocks every group has
        (a window group: the blocks token n * block_size attends to).

        At least one token is left uncached: the step must compute it to get logits.
        """
        if not self.enable_prefix_caching:
            return 0, []
        usable = (seq.num_tokens - 1) // self.block_size
        hashes = block_hashes(seq.token_ids[:usable * self.block_size], self.block_size, seq.cache_salt)
        n = len(hashes)
        for group, window in enumerate(self.windows):
            if window is None:
                n = next((i for i, h in enumerate(hashes[:n]) if (group, h) not in self._key_to_block), n)
        while n > 0 and not all(self._window_cached(g, hashes, n) for g, w in enumerate(self.windows) if w):
            n -= 1
        return n, hashes[:n]

    def _window_cached(self, group: int, hashes: list[int], n: int) -> bool:
        return all((group, h) in self._key_to_block for h in hashes[self._first_needed(group, n * self.block_size):n])

    def _hit_blocks(self, group: int, hashes: list[int]) -> list[int]:
        """`group`'s table entries for a prefix hit on `hashes`: NULL before the window, then the cached blocks."""
        lo = self._first_needed(group, len(hashes) * self.block_size)
        return [NULL] * lo + [self._key_to_block[(group, h)] for h in hashes[lo:]]

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether blocks for the current context of `seq` are available (a window group: its first step's)."""
        n, hashes = self._prefix_hits(seq)
        hits = [b for g in range(len(self.windows)) for b in self._hit_blocks(g, hashes) if b != NULL]
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = sum(self._table_end(g, n * self.block_size, seq.num_tokens) - n for g in range(len(self.windows)))
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> Allocation:
        """Give `seq` blocks for its context (a window group: its first step's), reusing cached prefix blocks."""
        assert seq.seq_id not in self._tables, f"sequence {seq.seq_id} already has blocks"
        assert self.can_allocate(seq), "allocate() without can_allocate()"
        n, hashes = self._prefix_hits(seq)
        tables = [self._hit_blocks(group, hashes) for group in range(len(self.windows))]
        for block_id in (b for table in tables for b in table if b != NULL):
            self._acquire(block_id)   # every group's hits before any fresh block can evict one of them
        for group, table in enumerate(tables):
            table += [self._take_free() for _ in range(self._table_end(group, n * self.block_size, seq.num_tokens) - n)]
        self._touch(hashes)
        self._tables[seq.seq_id] = tables
        self._hashes[seq.seq_id] = hashes
        cached = n * self.block_size
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += cached
        return Allocation(list(tables[0]), cached)

    # --- growth ----------------------------------------------------------------------------
    def _cow_needed(self, table: list[int], seq: Sequence) -> bool:
        """The block of `table` the next token is written into is shared with another sequence."""
        index = seq.num_computed_tokens // self.block_size
        return index < len(table) and self.blocks[table[index]].ref_count > 1

    def _missing(self, group: int, table: list[int], seq: Sequence) -> int:
        """Entries `table` lacks for the next step of `seq` (its draft included)."""
        return max(0, self._table_end(group, seq.num_computed_tokens, seq.num_tokens_with_draft) - len(table))

    def can_append(self, seq: Sequence) -> bool:
        needed = sum(self._missing(g, t, seq) + int(self._cow_needed(t, seq))
                     for g, t in enumerate(self._tables[seq.seq_id]))
        return needed <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> AppendResult:
        """Make room for the uncomputed tokens of `seq` the next step can compute (normally the one just
        sampled; a window group: at most max_step_tokens of a prompt's next chunk)."""
        assert self.can_append(seq), "append_slot() without can_append()"
        new: list[int] = []
        cow: list[tuple[int, int]] = []
        for group, table in enumerate(self._tables[seq.seq_id]):
            if self._cow_needed(table, seq):
                index = seq.num_computed_tokens // self.block_size
                src, dst = table[index], self._take_free()
                self._release(src)
                table[index] = dst
                cow.append((src, dst))
            fresh = [self._take_free() for _ in range(self._missing(group, table, seq))]
            table.extend(fresh)
            new += fresh
        return AppendResult(new, cow)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (e.g. parallel samples of one prompt)."""
        assert child.seq_id not in self._tables
        for block_id in self._held(parent):
            self._acquire(block_id)
        self._tables[child.seq_id] = [list(t) for t in self._tables[parent.seq_id]]
        self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])
        child.num_computed_tokens = parent.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s full blocks whose KV is now computed, then give back the
        window groups' blocks the next token no longer attends to (registered first: they stay hits)."""
        if self.enable_prefix_caching:
            self._register(seq)
        self._release_out_of_window(seq)

    def _register(self, seq: Sequence) -> None:
        hashes = self._hashes[seq.seq_id]
        tables = self._tables[seq.seq_id]
        parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
        tokens = seq.token_ids[:seq.num_computed_tokens]
        known = len(hashes)
        for block_hash in block_hashes(tokens, self.block_size, start=len(hashes), parent=parent):
            for group, table in enumerate(tables):
                block = self.blocks[table[len(hashes)]]
                if (group, block_hash) not in self._key_to_block and block.key is None:
                    block.key = (group, block_hash)
                    self._key_to_block[block.key] = block.block_id
            hashes.append(block_hash)
        if known < min(len(hashes), DISPATCH_PREFIX_BLOCKS):
            self._touch(hashes)

    def _release_out_of_window(self, seq: Sequence) -> None:
        for group, table in enumerate(self._tables[seq.seq_id]):
            for index in reversed(range(self._first_needed(group, seq.num_computed_tokens))):
                if table[index] == NULL:   # the ones before it went at an earlier step
                    break
                self._release(table[index])
                table[index] = NULL

    # --- release ---------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks (tail first, so the tail is evicted before the head)."""
        tables = self._tables.pop(seq.seq_id, [])
        self._hashes.pop(seq.seq_id, None)
        for table in tables:
            for block_id in reversed(table):
                if block_id != NULL:
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
            if block.key is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    def _evict(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block = self.blocks[block_id]
        assert block.key is not None
        del self._key_to_block[block.key]
        block.key = None
        return block_id

    def _take_free(self) -> int:
        block_id = self._free.popleft() if self._free else self._evict()
        self.blocks[block_id].ref_count = 1
        return block_id
