"""Text-level stop strings across token boundaries.

Text is held back while its tail could still become a stop string; once a stop
string appears, the text before it is released and the stop string itself never is.

    feed("Hello wor") with stop "world" → emit "Hello ", hold "wor"
    feed("ld!")                          → stop: emit "" (the "world" is dropped)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    text: str       # text that may go out now
    stopped: bool   # a stop string was found; nothing after it may go out


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def _held_suffix(self) -> int:
        """Length of the longest tail of pending that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return StopResult(out, True)
        keep = self._held_suffix()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return StopResult(out, False)

    def flush(self) -> str:
        """End of generation without a stop: release what was held."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
