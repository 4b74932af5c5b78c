"""The worker's inbox stream: batches the batcher dispatched to this worker.

Read with the consumer group keys.INBOX_GROUP, consumer = worker id. On start the
worker first re-reads its own pending entries (delivered before a restart, never acked).
An entry that does not decode (a bad deploy, version skew, a bug) is acknowledged and
deleted at once, counted and logged: it can never run, so it must not stop the loop or
come back on every read.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from gpu_worker import metrics
from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class InboxEntry:
    entry_id: str
    batch: queue_pb2.Batch


def _decode(entry_id: str, fields: dict) -> InboxEntry | None:
    """The entry's batch; None (logged) when it has no decodable one."""
    try:
        return InboxEntry(entry_id, queue.decode_batch(fields))
    except queue.Undecodable as exc:
        logger.error("dropping undecodable inbox entry", entry_id=entry_id, error=str(exc))
        return None


class Inbox:
    """Reads batches of one worker's inbox.

    Args:
        redis: client whose socket timeout exceeds `block_ms`.
        model: model id.
        worker_id: consumer name.
        shard: the queue cell the worker joined.
    """

    def __init__(self, redis: redis_client.AnyRedis, model: str, worker_id: str, shard: int = 0) -> None:
        self.redis = redis
        self.key = keys.inbox_stream(model, worker_id, shard)
        self.consumer = worker_id
        self._pending_from: str | None = "0"   # None once own pending entries were re-read

    async def ensure_group(self) -> None:
        await queue.ensure_group(self.redis, self.key, keys.INBOX_GROUP)

    @property
    def caught_up(self) -> bool:
        """Whether own pending entries were re-read; from then on `queue_read` may be used."""
        return self._pending_from is None

    async def read(self, count: int, block_ms: int | None) -> list[InboxEntry]:
        """Own pending entries first (once), then new ones; `block_ms` None = do not wait."""
        if self._pending_from is not None:
            entries = await self._read(self._pending_from, count, None)
            if entries:
                self._pending_from = entries[-1].entry_id
                return entries
            self._pending_from = None
        return await self._read(">", count, block_ms)

    def reread_pending(self) -> None:
        """A read's reply was lost: the entries it delivered are pending here; read them again."""
        self._pending_from = "0"

    def queue_read(self, pipe, count: int) -> None:
        """Queue a read of new entries (no wait) on `pipe`; its reply goes to `entries`."""
        pipe.xreadgroup(keys.INBOX_GROUP, self.consumer, {self.key: ">"}, count=count)

    async def _read(self, start: str, count: int, block_ms: int | None) -> list[InboxEntry]:
        reply = await self.redis.xreadgroup(keys.INBOX_GROUP, self.consumer, {self.key: start},
                                            count=count, block=block_ms)
        return await self.entries(reply)

    async def entries(self, reply) -> list[InboxEntry]:
        """The batches of an XREADGROUP reply; entries that do not decode are dropped (acked, deleted)."""
        out: list[InboxEntry] = []
        dropped: list[str] = []
        for _stream, messages in reply or []:
            for raw_id, fields in messages:
                if not fields:                 # deleted while pending: nothing left to run
                    continue
                entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
                entry = _decode(entry_id, fields)
                if entry is None:
                    dropped.append(entry_id)
                else:
                    out.append(entry)
        if dropped:
            await self.drop(dropped)
        return out

    async def drop(self, entry_ids: list[str]) -> None:
        """Acknowledge and delete entries that will never run."""
        pipe = self.redis.pipeline(transaction=False)
        queue.ack_and_delete(pipe, self.key, keys.INBOX_GROUP, entry_ids)
        await pipe.execute()
        metrics.INBOX_DROPPED.inc(len(entry_ids))
