"""Hash chain over full KV blocks, shared by the worker (prefix cache) and anyone
who wants to predict a cache hit (prefix-aware dispatch): both must agree bit for bit,
so the hash is a fixed function (BLAKE2b, 64 bits), not Python's `hash()`.

    block i hash = H(block i-1 hash || token ids of block i)      block -1 hash = ROOT_HASH

Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0
# Leading blocks of a context that prefix-aware dispatch compares; workers advertise only these.
DISPATCH_PREFIX_BLOCKS = 8


def chain_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (uint64)."""
    payload = struct.pack(f"<Q{len(block_tokens)}I", parent, *block_tokens)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, start: int = 0,
                 parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block index `start` on.

    Args:
        token_ids: the whole context.
        block_size: tokens per block.
        start: first block to hash; `parent` must be the hash of block start-1.
    """
    hashes: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
