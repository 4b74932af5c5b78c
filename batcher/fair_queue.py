"""Local read-ahead queues: strict priority between classes, token-fair across tenants.

Items read from the work streams stay pending in the consumer group (nothing is
lost if this process dies) and wait here until a batch takes them:

    HIGH   tenant a: [a1 a2 a3 ...]   served (virtual tokens): a 4,000  b 3,900
    NORMAL tenant c: [c1]             next item: the head of the least-served tenant
    LOW    ...                        (HIGH first, then NORMAL, then LOW)

Within a class, each tenant has a virtual token counter (VTC): every item it is
served adds the tokens that item costs (prompt and prior output, which the worker
prefills, plus the new tokens it may still generate: the batcher never sees the
tokens actually generated, so it charges max_new_tokens at dispatch) divided by
the tenant's weight (`tenant_weight` of the work item, from the tenants file).
The least-served tenant goes next (ties: the one served longest ago), so tenants
get tokens in proportion to their weights whatever their prompt lengths, and a
tenant alone gets everything. A tenant that (re)joins the class is lifted to the
least counter of the active tenants (the highest seen, when none is), so idling
banks no credit. With `count_tokens` off (batcher --fair-share requests) every item
costs 1 / weight: request round-robin, the baseline bench/scheduling.py compares with.

Latency targets come first within a class (earliest deadline first): an item with a TTFT
target has a next-token deadline (llmserve/protocol/slo.py); each tenant's queue is kept in deadline
order (items without one after, in read order), and while any tenant's head has a deadline,
the head with the earliest goes next, whatever the counters say. It is still charged, so a
tenant whose work carries targets pays for it in the token share of the untargeted rest.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from llmserve.protocol import keys, slo
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

    @property
    def deadline_ms(self) -> float:
        """The item's next-token deadline (unix ms; infinite without a TTFT target)."""
        return slo.item_deadline_ms(self.item)

    @property
    def virtual_tokens(self) -> float:
        """What serving this item adds to its tenant's counter: context plus the new tokens it may
        still generate, over the tenant's weight."""
        remaining = max(0, self.item.sampling.max_new_tokens - len(self.item.generated_token_ids))
        choices = len(self.item.choices) or max(1, self.item.n)      # n choices: each may generate
        return (self.prompt_tokens + remaining) * choices / (self.item.tenant_weight or 1.0)


@dataclass
class _ClassQueue:
    """One priority class: a queue per tenant (active tenants only, each in deadline order, then
    read order), served earliest head deadline first, else least-served first."""

    tenants: OrderedDict[str, list[Held]] = field(default_factory=OrderedDict)
    served: dict[str, float] = field(default_factory=dict)   # tenant → virtual tokens served
    size: int = 0
    count_tokens: bool = True

    def push(self, held: Held) -> None:
        tenant = held.item.tenant
        if tenant not in self.tenants:
            self._lift(tenant)
            self.tenants[tenant] = []
        bisect.insort_right(self.tenants[tenant], held, key=_deadline)   # equal deadlines keep read order
        self.size += 1

    def _lift(self, tenant: str) -> None:
        """A joining tenant starts no lower than the active ones (VTC's counter lift)."""
        active = [self.served[t] for t in self.tenants]
        floor = min(active) if active else max(self.served.values(), default=0.0)
        self.served[tenant] = max(self.served.get(tenant, 0.0), floor)

    def take(self, admit: Callable[[Held], bool]) -> Iterator[Held]:
        """Earliest head deadline, else least-served tenant first, one item at a time, while `admit` accepts.

        A tenant whose head item is refused sits out the rest of this batch.
        """
        blocked: set[str] = set()
        while self.size:
            tenant = self.next_tenant(blocked)
            if tenant is None:
                return
            if not admit(self.tenants[tenant][0]):
                blocked.add(tenant)
                continue
            yield self._pop(tenant)

    def next_tenant(self, blocked: Collection[str] = ()) -> str | None:
        """The tenant whose head has the earliest deadline; with none, the one with the least counter
        (ties: the one served longest ago)."""
        candidates = [t for t in self.tenants if t not in blocked]
        urgent = min(candidates, key=lambda t: self.tenants[t][0].deadline_ms, default=None)
        if urgent is not None and not math.isinf(self.tenants[urgent][0].deadline_ms):
            return urgent
        return min(candidates, key=self.served.__getitem__, default=None)

    def _pop(self, tenant: str) -> Held:
        fifo = self.tenants.pop(tenant)
        held = fifo.pop(0)
        self.size -= 1
        self.served[tenant] += held.virtual_tokens if self.count_tokens else 1 / (held.item.tenant_weight or 1.0)
        if fifo:
            self.tenants[tenant] = fifo  # re-inserted at the back: it now loses ties
        return held

    def remove_if(self, pred: Callable[[Held], bool]) -> list[Held]:
        removed: list[Held] = []
        for tenant in list(self.tenants):
            fifo = self.tenants[tenant]
            keep = [h for h in fifo if not pred(h)]
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

    def __init__(self, count_tokens: bool = True) -> None:
        self._classes: dict[int, _ClassQueue] = {p: _ClassQueue(count_tokens=count_tokens) for p in keys.PRIORITY_ORDER}
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
        """The item the next `take` offers first (highest class, its next tenant's head)."""
        for priority in keys.PRIORITY_ORDER:
            queue = self._classes[priority]
            tenant = queue.next_tenant()
            if tenant is not None:
                return queue.tenants[tenant][0].item
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
        """When the longest-waiting item started waiting."""
        return min((h.read_at for h in self), default=None)

    def __iter__(self) -> Iterator[Held]:
        for q in self._classes.values():
            yield from q

    def extend(self, items: Iterable[Held]) -> int:
        return sum(self.push(h) for h in items)


def _deadline(held: Held) -> float:
    return held.deadline_ms


def _priority_class(priority: int) -> int:
    """UNSPECIFIED (and anything unknown) is served as NORMAL."""
    return priority if priority in keys.PRIORITY_NAMES else keys.PRIORITY_ORDER[1]
