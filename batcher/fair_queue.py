"""Local read-ahead queues: strict priority between classes, round-robin across tenants.

Items read from the work streams stay pending in the consumer group (nothing is
lost if this process dies) and wait here until a batch takes them:

    HIGH   tenant a: [a1 a2 a3 ...]   rotation: a, b        batch = a1 b1 a2 ...
    NORMAL tenant c: [c1]                                    (HIGH first, then NORMAL,
    LOW    ...                                               then LOW)

A tenant with 1,000 queued items gets one slot per round, like any other
tenant of its class, so another tenant's single item rides in the next batch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from llmserve import keys
from llmserve.v1 import queue_pb2


@dataclass(slots=True, eq=False)
class Held:
    """A work item read from a stream and not yet dispatched or dropped."""

    stream: str                 # source stream key
    entry_id: str               # stream entry id
    item: queue_pb2.WorkItem
    read_at: float              # monotonic time the batch wait starts from
    touched_at: float = 0.0     # monotonic time its pending entry was last refreshed

    @property
    def ref(self) -> tuple[str, str]:
        return self.stream, self.entry_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.item.prompt_token_ids) + len(self.item.generated_token_ids)


@dataclass
class _ClassQueue:
    """One priority class: a FIFO per tenant and the order tenants are served in."""

    tenants: OrderedDict[str, deque[Held]] = field(default_factory=OrderedDict)
    size: int = 0

    def push(self, held: Held) -> None:
        self.tenants.setdefault(held.item.tenant, deque()).append(held)
        self.size += 1

    def take(self, admit: Callable[[Held], bool]) -> Iterator[Held]:
        """Round-robin over tenants, one item per tenant per round, while `admit` accepts.

        A tenant whose head item is refused sits out the rest of this batch; a
        served tenant moves to the back of the rotation so the next batch
        starts with the tenant after it.
        """
        blocked: set[str] = set()
        while self.size and len(blocked) < len(self.tenants):
            progressed = False
            for tenant in list(self.tenants):
                if tenant in blocked:
                    continue
                fifo = self.tenants[tenant]
                if not admit(fifo[0]):
                    blocked.add(tenant)
                    continue
                progressed = True
                yield self._pop(tenant)
            if not progressed:
                return

    def _pop(self, tenant: str) -> Held:
        fifo = self.tenants.pop(tenant)
        held = fifo.popleft()
        self.size -= 1
        if fifo:
            self.tenants[tenant] = fifo  # re-inserted at the back: its turn is over
        return held

    def remove_if(self, pred: Callable[[Held], bool]) -> list[Held]:
        removed: list[Held] = []
        for tenant in list(self.tenants):
            fifo = self.tenants[tenant]
            keep = deque(h for h in fifo if not pred(h))
            removed += [h for h in fifo if pred(h)]
            if keep:
                self.tenants[tenant] = keep
            else:
                del self.tenants[tenant]
        self.size -= len(removed)
        return removed

    def __iter__(self) -> Iterator[Held]:
        for fifo in self.tenants.values():
            yield from fifo


class FairQueue:
    """Per-priority, per-tenant queues of held items; see the module docstring."""

    def __init__(self) -> None:
        self._classes = {p: _ClassQueue() for p in keys.PRIORITY_ORDER}
        self._refs: set[tuple[str, str]] = set()
        self.prompt_tokens = 0  # of everything held

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, ref: tuple[str, str]) -> bool:
        return ref in self._refs

    def count(self, priority: int) -> int:
        return self._classes[priority].size

    def push(self, held: Held) -> bool:
        """Queue an item; False (and nothing queued) when the same entry is already held."""
        if held.ref in self._refs:
            return False
        self._refs.add(held.ref)
        self.prompt_tokens += held.prompt_tokens
        self._classes[_priority_class(held.item.priority)].push(held)
        return True

    def peek(self) -> queue_pb2.WorkItem | None:
        """The item the next `take` offers first (highest class, tenant first in its rotation)."""
        for priority in keys.PRIORITY_ORDER:
            tenants = self._classes[priority].tenants
            if tenants:
                return next(iter(tenants.values()))[0].item
        return None

    def take(self, admit: Callable[[Held], bool]) -> list[Held]:
        """Items for one batch in strict priority order; `admit` says whether the next one fits."""
        batch: list[Held] = []
        for priority in keys.PRIORITY_ORDER:
            for held in self._classes[priority].take(admit):
                self._refs.discard(held.ref)
                self.prompt_tokens -= held.prompt_tokens
                batch.append(held)
        return batch

    def remove_if(self, pred: Callable[[Held], bool]) -> list[Held]:
        removed = [h for q in self._classes.values() for h in q.remove_if(pred)]
        for held in removed:
            self._refs.discard(held.ref)
            self.prompt_tokens -= held.prompt_tokens
        return removed

    def oldest_read_at(self) -> float | None:
        """When the longest-waiting item started waiting (heads only: each FIFO is in read order)."""
        return min((f[0].read_at for q in self._classes.values() for f in q.tenants.values()), default=None)

    def __iter__(self) -> Iterator[Held]:
        for q in self._classes.values():
            yield from q

    def extend(self, items: Iterable[Held]) -> int:
        return sum(self.push(h) for h in items)


def _priority_class(priority: int) -> int:
    """UNSPECIFIED (and anything unknown) is served as NORMAL."""
    return priority if priority in keys.PRIORITY_NAMES else keys.PRIORITY_ORDER[1]
