"""The worker's inbox stream: batches the batcher dispatched to this worker.

Read with the consumer group keys.INBOX_GROUP, consumer = worker id. On start the
worker first re-reads its own pending entries (delivered before a restart, never acked).
An entry that does not decode (a bad deploy, version skew, a bug) is acknowledged and
deleted at once, counted and logged: it can never run, so it must not stop the loop or
come back on every read.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions
import structlog

from google.protobuf.message import DecodeError

from gpu_worker import metrics
from llmserve import keys
from llmserve.v1 import queue_pb2

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class InboxEntry:
    entry_id: str
    batch: queue_pb2.Batch


def _decode(entry_id: bytes | str, fields: dict) -> InboxEntry | None:
    """The entry's batch; None when it has no decodable one."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    raw = fields.get(b"batch") or fields.get("batch")
    if raw is None:
        logger.error("dropping inbox entry without a batch field", entry_id=eid, fields=sorted(map(str, fields)))
        return None
    try:
        return InboxEntry(eid, queue_pb2.Batch.FromString(raw))
    except DecodeError as exc:
        logger.error("dropping undecodable inbox entry", entry_id=eid, error=str(exc), size=len(raw))
        return None


class Inbox:
    """Reads batches of one worker's inbox.

    Args:
        redis: client whose socket timeout exceeds `block_ms`.
        model: model id.
        worker_id: consumer name.
    """

    def __init__(self, redis: aioredis.Redis, model: str, worker_id: str) -> None:
        self.redis = redis
        self.key = keys.inbox_stream(model, worker_id)
        self.consumer = worker_id
        self._pending_from: str | None = "0"   # None once own pending entries were re-read

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.key, keys.INBOX_GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int | None) -> list[InboxEntry]:
        """Own pending entries first (once), then new ones; `block_ms` None = do not wait."""
        if self._pending_from is not None:
            entries = await self._read(self._pending_from, count, None)
            if entries:
                self._pending_from = entries[-1].entry_id
                return entries
            self._pending_from = None
        return await self._read(">", count, block_ms)

    async def _read(self, start: str, count: int, block_ms: int | None) -> list[InboxEntry]:
        reply = await self.redis.xreadgroup(keys.INBOX_GROUP, self.consumer, {self.key: start},
                                            count=count, block=block_ms)
        out: list[InboxEntry] = []
        dropped: list[str] = []
        for _stream, messages in reply or []:
            for eid, fields in messages:
                if not fields:                 # deleted while pending: nothing left to run
                    continue
                entry = _decode(eid, fields)
                if entry is None:
                    dropped.append(eid.decode() if isinstance(eid, bytes) else eid)
                else:
                    out.append(entry)
        if dropped:
            await self.drop(dropped)
        return out

    async def drop(self, entry_ids: list[str]) -> None:
        """Acknowledge and delete entries that will never run."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.key, keys.INBOX_GROUP, *entry_ids)
        pipe.xdel(self.key, *entry_ids)
        await pipe.execute()
        metrics.INBOX_DROPPED.inc(len(entry_ids))
