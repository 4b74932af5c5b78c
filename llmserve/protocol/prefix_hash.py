"""Hash chain over full KV blocks, shared by the worker (prefix cache) and anyone
who wants to predict a cache hit (prefix-aware dispatch): both must agree bit for bit,
so the hash is a fixed function (BLAKE2b, 64 bits), not Python's `hash()`.

    block i hash = H(block i-1 hash || token ids of block i)      block -1 hash = root_hash(salt)

The salt is the work item's `cache_salt`, set by the gateway per tenant (or per
cache_group): the same tokens of two salts hash apart, so one tenant can never hit,
or learn about, blocks another tenant computed. The empty salt keeps ROOT_HASH.

Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0
# Leading blocks of a context that prefix-aware dispatch compares; workers advertise only these.
DISPATCH_PREFIX_BLOCKS = 8
_SALT_PERSON = b"llmserve-salt"   # BLAKE2b personalisation: salt roots are hashed apart from blocks


def chain_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (uint64)."""
    payload = struct.pack(f"<Q{len(block_tokens)}I", parent, *block_tokens)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def root_hash(salt: str) -> int:
    """The parent hash of a context's first block under a cache salt."""
    if not salt:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(salt.encode("utf-8"), digest_size=8, person=_SALT_PERSON).digest(),
                          "little")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "", start: int = 0,
                 parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block index `start` on.

    Args:
        token_ids: the whole context.
        block_size: tokens per block.
        salt: the cache salt of the context (see the module docstring).
        start: first block to hash; `parent` must then be the hash of block start-1.
    """
    if parent is None:
        assert start == 0, "a chain continued from block start > 0 needs its parent hash"
        parent = root_hash(salt)
    hashes: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
