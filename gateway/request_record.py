"""The request record: one hash per request in Redis (`keys.request_meta`), the one owner of its
fields. The gateway that admits a request claims and writes it; every gateway that serves a
resume reads it and counts its viewers; the worker's fenced event writes only extend its TTL.

    owner        tenant id, set once by the claim (HSETNX)
    model ...    the admitted `Meta` (gateway/request_state.py), written before the work item is queued
    entry_id     the work stream entry, once queued (tells a queued request from a dispatched one)
    viewers      streams attached now (a resume adds one)
    error        why it failed for good before any token (a resume fails the same way)
    done         set once it finished or was cancelled
"""

from __future__ import annotations

from typing import Any, cast

from gateway.request_state import Meta
from llmserve.protocol import keys
from llmserve.runtime import redis_client

# The fields this module writes itself (the admitted Meta's are Meta.to_redis's).
OWNER, ENTRY_ID, VIEWERS, ERROR, DONE = "owner", "entry_id", "viewers", "error", "done"
# KEYS: [1] request record  [2] events stream  [3] cancel key  ARGV: [1] owner  [2] ttl s  [3] OWNER
# Returns 1 when claimed, 0 when the request_id is taken. One script: the record never exists
# without its TTL, and leftovers of an expired earlier request with this id cannot leak into this one.
_CLAIM = """
if redis.call('HSETNX', KEYS[1], ARGV[3], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
return 1
"""


class RequestRecord:
    """The record of one request of one tenant."""

    def __init__(self, redis: redis_client.AnyRedis, tenant: str, request_id: str) -> None:
        self.redis, self.tenant, self.request_id = redis, tenant, request_id
        self.key = keys.request_meta(tenant, request_id)

    async def claim(self, ttl_s: int) -> bool:
        """Make the caller the request's creator; False when the request_id was claimed first."""
        claimed = await self.redis.eval(_CLAIM, 3, self.key, keys.events_stream(self.tenant, self.request_id),
                                        keys.cancel_key(self.tenant, self.request_id), self.tenant, ttl_s, OWNER)
        return bool(claimed)

    async def read(self) -> Meta | None:
        """The admitted request of this tenant; None while it is claimed but not yet written, or gone."""
        raw = cast(dict[bytes, bytes], await self.redis.hgetall(self.key))
        if not raw or raw.get(OWNER.encode(), b"").decode() != self.tenant or b"enqueued_ms" not in raw:
            return None
        return Meta.from_redis(raw)

    async def write(self, meta: Meta) -> None:
        await self.redis.hset(self.key, mapping=meta.to_redis())

    async def set_entry(self, entry_id: str) -> None:
        await self.redis.hset(self.key, ENTRY_ID, entry_id)

    async def delete(self) -> None:
        await self.redis.delete(self.key)

    async def add_viewer(self, change: int) -> int:
        """Count a viewer in (+1) or out (-1); the viewers attached after the change."""
        return int(await self.redis.hincrby(self.key, VIEWERS, change))

    async def carried_on(self) -> bool:
        """Whether another viewer still streams it, or it is done."""
        return int(await self.redis.hget(self.key, VIEWERS) or 0) > 0 or bool(await self.redis.hget(self.key, DONE))

    async def fail(self, failure: str) -> None:
        await self.redis.hset(self.key, ERROR, failure)

    async def mark_done(self) -> None:
        await self.redis.hset(self.key, DONE, "1")

    def mark_done_in(self, pipe: Any) -> None:
        """Queue `done` in a pipeline the caller executes (with the cancel key)."""
        pipe.hset(self.key, DONE, "1")

    async def keep_for(self, ttl_s: int) -> None:
        await self.redis.expire(self.key, ttl_s)

    async def owner(self) -> str | None:
        owner = cast(bytes | None, await self.redis.hget(self.key, OWNER))
        return owner.decode() if owner is not None else None
