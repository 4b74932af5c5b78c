"""Block manager: exact block ids for allocate, append, fork/share, free, prefix hits, eviction."""

from __future__ import annotations

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.sequence import SamplingParams, Sequence
from llmserve.protocol.prefix_hash import DISPATCH_PREFIX_BLOCKS, ROOT_HASH, block_hashes, chain_hash, root_hash

BS = 4


def make_seq(tokens: list[int], salt: str = "") -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0.0), cache_salt=salt)


def make_manager(num_blocks: int = 8, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching)


def computed(manager: BlockManager, seq: Sequence) -> None:
    """Pretend a forward computed every token of seq."""
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_computed_blocks(seq)


def test_allocate_takes_blocks_in_free_list_order():
    m = make_manager()
    a, b = make_seq(range(10)), make_seq(range(100, 105))
    assert m.allocate(a).block_ids == [0, 1, 2]
    assert m.allocate(b).block_ids == [3, 4]
    assert m.num_free_blocks == 3


def test_can_allocate_refuses_when_short():
    m = make_manager(num_blocks=2)
    assert not m.can_allocate(make_seq(range(9)))
    assert m.can_allocate(make_seq(range(8)))


def test_append_slot_adds_block_only_at_boundary():
    m = make_manager()
    seq = make_seq(range(4))
    m.allocate(seq)
    computed(m, seq)
    seq.append_token(50)                  # position 4 → needs block 2 of the table
    result = m.append_slot(seq)
    assert result.new_block_ids == [1]
    seq.num_computed_tokens = 5
    seq.append_token(51)
    assert m.append_slot(seq).new_block_ids == []
    assert m.block_table(seq) == [0, 1]


def test_can_append_false_when_no_block_left():
    m = make_manager(num_blocks=1)
    seq = make_seq(range(4))
    m.allocate(seq)
    computed(m, seq)
    seq.append_token(9)
    assert not m.can_append(seq)


def test_free_returns_uncached_blocks_to_free_list_tail():
    m = make_manager(num_blocks=4, caching=False)
    a = make_seq(range(6))
    m.allocate(a)                          # [0, 1]
    m.free(a)
    b = make_seq(range(16))
    assert m.allocate(b).block_ids == [2, 3, 1, 0]   # free list: 2 3 then freed tail-first 1 0


def test_prefix_hit_shares_full_blocks_and_counts_tokens():
    m = make_manager()
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.allocate(a)                          # [0, 1, 2]
    computed(m, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    alloc = m.allocate(b)
    assert alloc.block_ids == [0, 1, 3]
    assert alloc.num_cached_tokens == 8
    assert [m.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert m.stats.queried_tokens == 19 and m.stats.hit_tokens == 8


def test_prefix_hit_leaves_last_token_to_compute():
    m = make_manager()
    a = make_seq(range(8))
    m.allocate(a)
    computed(m, a)
    b = make_seq(range(8))                 # identical, block aligned
    alloc = m.allocate(b)
    assert alloc.num_cached_tokens == 4    # block 1 is recomputed so the step has a token to sample from
    assert alloc.block_ids == [0, 2]


def test_blocks_not_computed_are_not_hits():
    m = make_manager()
    a = make_seq(range(9))
    m.allocate(a)                          # nothing computed yet
    assert m.allocate(make_seq(range(9))).num_cached_tokens == 0


def test_freed_cached_blocks_revive_and_evict_lru_tail_first():
    m = make_manager(num_blocks=4)
    a = make_seq(range(12))                # 3 full blocks [0, 1, 2]
    m.allocate(a)
    computed(m, a)
    m.free(a)                              # evictable LRU: 2, 1, 0 (tail first)
    assert m.num_free_blocks == 4
    b = make_seq(range(200, 212))          # needs 3 blocks: free 3, then evicts 2, then 1
    assert m.allocate(b).block_ids == [3, 2, 1]
    c = make_seq([0, 1, 2, 3, 99])         # block 0 still cached: a hit
    assert m.can_allocate(c) is False      # needs the hit + 1 fresh, only block 0 left
    m.free(b)                              # uncomputed: back to the free list tail-first: 1, 2, 3
    assert m.allocate(c).block_ids == [0, 1]
    assert m.allocate(make_seq([7])).block_ids == [2]


def test_eviction_drops_hash_so_stale_block_is_not_hit():
    m = make_manager(num_blocks=2)
    a = make_seq(range(5))
    m.allocate(a)
    computed(m, a)
    m.free(a)                              # block 0 cached+evictable, block 1 free
    m.allocate(make_seq(range(100, 108)))  # takes 1, then evicts 0
    assert m.cached_hashes(10) == []


def test_fork_shares_and_copy_on_write_on_partial_block():
    m = make_manager()
    parent = make_seq(range(6))            # blocks [0, 1], block 1 half full
    m.allocate(parent)
    computed(m, parent)
    child = make_seq(range(6))
    m.fork(parent, child)
    assert m.block_table(child) == [0, 1]
    assert m.blocks[1].ref_count == 2
    child.append_token(77)
    result = m.append_slot(child)
    assert result.copy_on_write == [(1, 2)]
    assert m.block_table(child) == [0, 2]
    assert m.block_table(parent) == [0, 1]
    assert [m.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]


def test_preemption_free_then_reallocate_hits_own_blocks():
    m = make_manager(num_blocks=4)
    seq = make_seq(range(10))
    m.allocate(seq)                        # [0, 1, 2]
    computed(m, seq)
    m.free(seq)
    seq.reset_for_recompute()
    alloc = m.allocate(seq)
    assert alloc.block_ids == [0, 1, 3]    # two full blocks reused, block 2 (partial) was never cached
    assert alloc.num_cached_tokens == 8


def test_cached_hashes_match_the_chain_first_block_first():
    m = make_manager()
    seq = make_seq(range(8))
    m.allocate(seq)
    computed(m, seq)
    h = block_hashes(list(range(8)), BS)
    assert h == [chain_hash(0, [0, 1, 2, 3]), chain_hash(h[0], [4, 5, 6, 7])]
    assert m.cached_hashes(10) == [h[0], h[1]]
    assert m.cached_hashes(1) == [h[0]]


def test_only_leading_blocks_are_advertised():
    m = make_manager(num_blocks=16)
    seq = make_seq(range(4 * 12))                         # 12 full blocks
    m.allocate(seq)
    computed(m, seq)
    assert m.cached_hashes(100) == block_hashes(list(range(4 * 12)), BS)[:DISPATCH_PREFIX_BLOCKS]


def test_cached_hashes_put_a_prefix_hit_back_in_front():
    m = make_manager()
    shared = make_seq(range(8))
    m.allocate(shared)
    computed(m, shared)
    other = make_seq(range(100, 108))
    m.allocate(other)
    computed(m, other)
    h_shared, h_other = block_hashes(list(range(8)), BS), block_hashes(list(range(100, 108)), BS)
    assert m.cached_hashes(2) == [h_other[0], h_other[1]]
    again = make_seq([*range(8), 9])                     # hits both blocks of `shared`
    m.allocate(again)
    assert m.cached_hashes(3) == [h_shared[0], h_shared[1], h_other[0]]


def test_duplicate_computation_keeps_first_block_registered():
    m = make_manager()
    a, b = make_seq(range(5)), make_seq(range(5))
    m.allocate(a)
    m.allocate(b)                          # both miss: [0, 1] and [2, 3]
    computed(m, a)
    computed(m, b)
    m.free(b)
    assert m.num_free_blocks == 6
    assert m.blocks[2].key is None  # b's copy is plain free, a's block 0 is the cached one
    assert m.allocate(make_seq([0, 1, 2, 3, 9])).block_ids == [0, 4]


# -- cache salt: tenants (cache groups) never share blocks ------------------------------------------------
def test_same_tokens_under_another_salt_miss_and_are_computed_afresh():
    m = make_manager()
    victim = make_seq(range(9), salt="tenant:victim")
    m.allocate(victim)
    computed(m, victim)
    m.free(victim)
    probe = m.allocate(make_seq(range(9), salt="tenant:attacker"))
    assert probe.num_cached_tokens == 0
    assert probe.block_ids == [3, 4, 5]     # fresh blocks, not the victim's cached [0, 1]
    assert m.stats.hit_tokens == 0
    mate = m.allocate(make_seq(range(9), salt="tenant:victim"))
    assert mate.num_cached_tokens == 8 and mate.block_ids[:2] == [0, 1]


def test_salted_chain_differs_from_block_zero_on_and_is_advertised_salted():
    m = make_manager()
    seq = make_seq(range(8), salt="group:acme")
    m.allocate(seq)
    computed(m, seq)
    salted, plain = block_hashes(list(range(8)), BS, "group:acme"), block_hashes(list(range(8)), BS)
    assert salted[0] == chain_hash(root_hash("group:acme"), [0, 1, 2, 3]) != plain[0]
    assert salted[1] != plain[1]
    assert m.cached_hashes(10) == salted
    assert root_hash("") == ROOT_HASH and root_hash("group:a") != root_hash("group:b")


def test_blocks_cached_after_admission_continue_the_salted_chain():
    m = make_manager()
    seq = make_seq(range(3), salt="tenant:t")      # no full block at admission: the chain starts later
    m.allocate(seq)
    for token in range(3, 8):
        seq.append_token(token)
        if m.can_append(seq):
            m.append_slot(seq)
    computed(m, seq)
    m.free(seq)
    again = m.allocate(make_seq(range(9), salt="tenant:t"))
    assert again.num_cached_tokens == 8
    assert m.allocate(make_seq(range(9))).num_cached_tokens == 0


# -- KV groups: a sliding-window group gives back the blocks behind its window ---------------------------
def make_windowed(num_blocks: int = 16, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching, windows=(None, 6))


def test_every_group_gets_its_own_blocks_from_one_pool():
    m = make_windowed()
    seq = make_seq(range(6))
    assert m.allocate(seq).block_ids == [0, 1]
    assert (m.block_table(seq, 1), m.num_free_blocks, m.blocks_needed(6)) == ([2, 3], 12, 4)


def test_a_window_group_releases_blocks_the_next_token_cannot_see():
    m = make_windowed()
    seq = make_seq(range(14))              # full [0 1 2 3], window [4 5 6 7]
    m.allocate(seq)
    computed(m, seq)                       # token 14 sees 9 .. 14: window blocks 2, 3
    assert [m.num_held_blocks(seq, g) for g in (0, 1)] == [4, 2]
    assert m.block_table(seq, 1) == [0, 0, 6, 7]   # given back: read as block 0, masked by the window
    assert m.num_free_blocks == 10 and m.num_exclusive_blocks(seq) == 6
    m.free(seq)
    assert m.num_free_blocks == 16


def test_a_prefix_hit_needs_only_the_window_blocks_of_a_window_group():
    m = make_windowed()
    a = make_seq(range(20))
    m.allocate(a)                          # full [0 1 2 3 4], window [5 6 7 8 9]
    computed(m, a)                         # token 20 sees 15 .. 20: window gives back 5, 6, 7
    m.reset_prefix_cache()                 # ... and they are forgotten
    b = make_seq([*range(20), 99])         # 5 blocks shared; token 20 needs only window blocks 3, 4
    alloc = m.allocate(b)
    assert (alloc.num_cached_tokens, alloc.block_ids) == (20, [0, 1, 2, 3, 4, 10])
    assert m.block_table(b, 1) == [0, 0, 0, 8, 9, 11]


def test_fork_and_copy_on_write_cover_every_group():
    m = make_windowed(caching=False)
    parent = make_seq(range(6))
    m.allocate(parent)                     # full [0 1], window [2 3]
    computed(m, parent)
    child = make_seq(range(6))
    m.fork(parent, child)
    child.append_token(9)
    assert m.append_slot(child).copy_on_write == [(1, 4), (3, 5)]


# -- a window group takes blocks one step ahead only: a long prompt's chunks stay within window + chunk ------
def step(manager: BlockManager, seq: Sequence, tokens: int) -> None:
    """Pretend a forward computed the next `tokens` of seq, then make room for its next step."""
    seq.num_computed_tokens += tokens
    manager.cache_computed_blocks(seq)
    if seq.num_uncomputed:
        manager.append_slot(seq)


def test_a_window_group_prefills_chunk_by_chunk_within_window_plus_one_chunk():
    m = BlockManager(16, BS, windows=(None, 6), max_step_tokens=8)
    seq = make_seq(range(20))
    assert m.blocks_needed(20) == 7                   # full 5, window 2 (tokens 0-7), not 2 x 5
    assert m.allocate(seq).block_ids == [0, 1, 2, 3, 4]
    assert (m.block_table(seq, 1), m.num_free_blocks) == ([5, 6], 9)
    step(m, seq, 8)                                   # 8 sees 3 ..: nothing to give back; room for 8-15
    assert m.block_table(seq, 1) == [5, 6, 7, 8]
    step(m, seq, 8)                                   # 16 sees 11 ..: tokens 0-7 given back; room for 16-19
    assert (m.block_table(seq, 1), m.num_held_blocks(seq, 1)) == ([0, 0, 7, 8, 9], 3)
    step(m, seq, 4)
    assert (m.num_held_blocks(seq, 1), m.num_free_blocks) == (2, 16 - 7)
    m.free(seq)
    assert m.num_free_blocks == 16


def test_a_long_prompt_fits_a_pool_smaller_than_its_context_in_every_group():
    m = BlockManager(9, BS, windows=(None, 6), max_step_tokens=8)   # peak: full 5 + window 4
    seq = make_seq(range(20))
    assert m.can_allocate(seq) and not BlockManager(9, BS, windows=(None, 6)).can_allocate(seq)
    m.allocate(seq)
    step(m, seq, 8)
    assert m.num_free_blocks == 0
    step(m, seq, 8)                                   # gives back 2 before taking 1
    assert m.num_free_blocks == 1
    step(m, seq, 4)
    assert m.num_free_blocks == 2


def test_a_chunked_prefix_hit_takes_the_window_blocks_and_one_step_ahead():
    m = BlockManager(32, BS, windows=(None, 6), max_step_tokens=4)
    a = make_seq(range(20))
    m.allocate(a)
    for _ in range(5):
        step(m, a, 4)
    m.free(a)
    b = make_seq([*range(20), *range(100, 112)])     # 5 blocks shared; token 20 sees 15 ..: window blocks 3, 4
    assert m.allocate(b).num_cached_tokens == 20
    assert m.block_table(b, 1)[:3] == [0, 0, 0]
    assert [m.num_held_blocks(b, g) for g in (0, 1)] == [8, 3]   # full: the context; window: 3, 4 + tokens 20-23
