"""Which pool process gets the next task: per-process, per-lane in-flight accounting.

Policy (no head-of-line blocking):
  - an interactive (short) task goes to the process with the fewest interactive tasks in
    flight, preferring one whose bulk lane is idle (its CPU is free), then the least loaded;
  - a bulk (long) task goes to the process with the fewest bulk bytes in flight, then the
    fewest interactive tasks.
Ties rotate, so equal processes share the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizer_svc.protocol import LANE_BULK, LANE_INTERACTIVE, LANES


@dataclass
class ProcessLoad:
    """What the front has sent to one pool process and not yet had back."""

    count: list[int] = field(default_factory=lambda: [0 for _ in LANES])  # tasks per lane
    cost: list[int] = field(default_factory=lambda: [0 for _ in LANES])   # input bytes per lane

    def add(self, lane: int, cost: int) -> None:
        self.count[lane] += 1
        self.cost[lane] += cost

    def remove(self, lane: int, cost: int) -> None:
        self.count[lane] -= 1
        self.cost[lane] -= cost
        assert self.count[lane] >= 0 and self.cost[lane] >= 0, "load accounting went negative"

    @property
    def total(self) -> int:
        return sum(self.count)


def _key(load: ProcessLoad, lane: int) -> tuple[int, ...]:
    if lane == LANE_INTERACTIVE:
        return (load.count[LANE_INTERACTIVE], min(load.count[LANE_BULK], 1), load.cost[LANE_BULK])
    return (load.cost[LANE_BULK], load.count[LANE_INTERACTIVE])


class Dispatcher:
    """Chooses among the ready processes' loads; remembers where ties last went."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, loads: Sequence[ProcessLoad], lane: int) -> int:
        """Index (into `loads`) of the process for a task on `lane`; `loads` must not be empty."""
        assert loads, "no process to choose from"
        n = len(loads)
        start = self._next % n
        best = min(range(n), key=lambda i: (_key(loads[i], lane), (i - start) % n))
        self._next = best + 1
        return best
