"""A byte-bounded LRU map: recent encodings keyed by their exact input.

Used twice: in the gRPC front, (model, exact request) → token ids, so a repeated
request never reaches the pool; and in each pool process, chat segment text →
token ids (see segments.py). Sizes are estimates (key text + 4 bytes per id),
which is what the memory bound needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUCache(Generic[V]):
    """Least-recently-used eviction under a byte budget; `hits`/`misses` count lookups."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> V | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key: Hashable, value: V, size: int) -> bool:
        """Insert (or refresh) an entry; False when it is larger than an eighth of the budget
        (one huge document must not flush everything else)."""
        if size * 8 > self.max_bytes:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self.bytes -= evicted
        return True

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0
