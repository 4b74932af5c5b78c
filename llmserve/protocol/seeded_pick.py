"""A weighted choice fixed by a string: the same key always gets the same pick for the same weights.

Used where a request must land on the same target on a retry or a resume without any stored
state: the model version behind an alias (gateway/model_router.py) and the queue cell of a request
(llmserve/protocol/queue_cells.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TypeVar

K = TypeVar("K", str, int)


def weighted_pick(weights: Mapping[K, int], key: str, salt: str) -> K:
    """One target, with probability weight / total, fixed by (key, salt). Needs a positive total."""
    total = sum(weights.values())
    digest = hashlib.blake2b(f"{salt}\0{key}".encode(), digest_size=8).digest()
    point = int.from_bytes(digest, "big") % total
    for target in sorted(weights):
        point -= weights[target]
        if point < 0:
            return target
    raise AssertionError("weights changed under the pick")
