"""The one wall clock: milliseconds, the time unit of every timestamp in the queue protocol
(deadlines, arrival, enqueue, heartbeats), comparable across processes and hosts; seconds where
a format asks for them (trace spans, OpenAI's `created`)."""

from __future__ import annotations

import time


def now_ms() -> int:
    """Unix time in whole milliseconds."""
    return int(time.time() * 1000)


def now_ms_precise() -> float:
    """Unix time in milliseconds with the fraction: a latency measured from a `now_ms()` stamp."""
    return time.time() * 1000


def now_s() -> float:
    """Unix time in seconds."""
    return time.time()
