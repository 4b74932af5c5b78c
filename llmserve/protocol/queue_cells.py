"""Queue cells: which of a model's `queue_shards` cells a worker joins and a request goes to.

A model's queue is `queue_shards` independent cells (llmserve/protocol/keys.py), each in its own
Redis Cluster slot, so no single shard carries all of a model's queue traffic. Each cell
is a whole queue: work streams with their priorities, a batch loop with its tenant
fairness, and the workers that joined it. The two choices that keep cells balanced:

    worker start:  join the cell with the fewest live workers; ties go round-robin by a ticket
                   from one counter, so workers that start together spread over the cells
    request:       a cell chosen with probability ∝ its live workers, seeded by the
                   request's uid (a retry lands in the same cell); cell 0 when no cell
                   has one (the first worker to start joins cell 0)

So every cell's queue is fed in proportion to the workers that drain it, and priorities
and fairness hold inside each cell, over a uniform sample of the traffic.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from llmserve.protocol import keys
from llmserve.protocol.seeded_pick import weighted_pick
from llmserve.runtime import redis_client
from llmserve.runtime.clock import now_ms
from llmserve.v1 import queue_pb2

# A heartbeat older than this is a silent worker (the batcher's default heartbeat_ttl_ms).
LIVE_WITHIN_MS = 3000


async def live_workers(redis: redis_client.AnyRedis, model: str, shards: int,
                       live_within_ms: int = LIVE_WITHIN_MS) -> list[int]:
    """Live, non-draining workers per cell (one pipelined round trip)."""
    return [len(cell) for cell in await live_heartbeats(redis, model, shards, live_within_ms)]


async def live_heartbeats(redis: redis_client.AnyRedis, model: str, shards: int,
                          live_within_ms: int = LIVE_WITHIN_MS) -> list[list[queue_pb2.WorkerHeartbeat]]:
    """The heartbeats of live, non-draining workers per cell (one pipelined round trip)."""
    pipe = redis.pipeline(transaction=False)
    for shard in range(shards):
        pipe.hvals(keys.workers_hash(model, shard))
    stamp = now_ms()
    return [[beat for raw in values if (beat := _live(raw, stamp, live_within_ms)) is not None]
            for values in await pipe.execute()]


async def join(redis: redis_client.AnyRedis, model: str, shards: int) -> int:
    """The cell a starting worker joins (one INCR and one read of every cell's heartbeats)."""
    if shards == 1:
        return 0
    ticket = int(await redis.incr(keys.cell_joins(model)))
    return cell_to_join(await live_workers(redis, model, shards), ticket)


def cell_to_join(counts: Sequence[int], ticket: int = 0) -> int:
    """The cell with the fewest live workers; among equals, the first from `ticket` round-robin."""
    cells = len(counts)
    return min(range(cells), key=lambda k: (counts[k], (k - ticket) % cells))


def cell_for_request(counts: Sequence[int], request_uid: str) -> int:
    """A cell with probability ∝ its live workers, the same one for the same request uid."""
    if sum(counts) == 0:
        return 0
    return weighted_pick(dict(enumerate(counts)), request_uid, "cell")


class CellChooser:
    """The gateway's side: `cell_for_request` over live-worker counts read at most every `refresh_s`."""

    def __init__(self, redis: redis_client.AnyRedis, shards: int, refresh_s: float = 0.5) -> None:
        self.redis, self.shards, self.refresh_s = redis, shards, refresh_s
        self._counts: dict[str, tuple[float, list[int]]] = {}

    async def choose(self, model: str, request_uid: str) -> int:
        if self.shards == 1:
            return 0
        read_at, counts = self._counts.get(model, (0.0, []))
        if time.monotonic() - read_at >= self.refresh_s:
            counts = await live_workers(self.redis, model, self.shards)
            self._counts[model] = (time.monotonic(), counts)
        return cell_for_request(counts, request_uid)


def _live(raw: bytes, stamp: int, live_within_ms: int) -> queue_pb2.WorkerHeartbeat | None:
    try:
        beat = queue_pb2.WorkerHeartbeat.FromString(raw)
    except Exception:  # noqa: BLE001 - DecodeError and friends: an undecodable heartbeat is no worker
        return None
    return beat if not beat.draining and stamp - beat.sent_unix_ms < live_within_ms else None
