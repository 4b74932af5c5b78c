"""Lua scripts: the only way the batcher moves items between streams.

`dispatch` is the atomic hand-over: it checks that every source entry is still
pending on *this* consumer (another replica may have reclaimed it), and only
then XADDs the batch to the worker inbox and XACKs + XDELs the sources, all in
one script. An item is therefore in exactly one place at any time: a work
stream / dead inbox (pending) or a live worker's inbox. Every key it touches
shares the queue cell's `{m:<model>}` hash tag, so it runs unchanged on Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.protocol import keys, queue
from llmserve.runtime import redis_client

# KEYS: [1] target inbox  [2] inboxes set  [3..] source streams
# ARGV: [1] batch bytes ('' = only ack the sources)  [2] target worker id  [3] inbox group
#       [4] consumer  then per source: group, n, id_1 .. id_n
# Returns {1, inbox entry id} or {0, {source index, id, ...}} for entries no longer ours.
_DISPATCH = """
local consumer = ARGV[4]
local pos = 5
local sources = {}
for k = 3, #KEYS do
  local group, n = ARGV[pos], tonumber(ARGV[pos + 1])
  local ids = {}
  for j = 1, n do ids[j] = ARGV[pos + 1 + j] end
  pos = pos + 2 + n
  sources[#sources + 1] = {KEYS[k], group, ids}
end
local lost = {}
for s, src in ipairs(sources) do
  for _, id in ipairs(src[3]) do
    if #redis.call('XPENDING', src[1], src[2], id, id, 1, consumer) == 0 then
      lost[#lost + 1] = s - 1
      lost[#lost + 1] = id
    end
  end
end
if #lost > 0 then return {0, lost} end
local entry = ''
if ARGV[1] ~= '' then
  if redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[3], '0', 'MKSTREAM')
  end
  entry = redis.call('XADD', KEYS[1], '*', '%(batch_field)s', ARGV[1])
  redis.call('SADD', KEYS[2], ARGV[2])
end
for _, src in ipairs(sources) do
  if #src[3] > 0 then
    redis.call('XACK', src[1], src[2], unpack(src[3]))
    redis.call('XDEL', src[1], unpack(src[3]))
  end
end
return {1, entry}
""" % {"batch_field": queue.BATCH_FIELD}

# KEYS: [1] stream   ARGV: [1] group [2] consumer [3..] ids
# Resets the idle time of entries still pending on `consumer` (so no replica
# reclaims items this one holds in its local queues); returns the ids it lost.
_TOUCH = """
local lost = {}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 0 then
    lost[#lost + 1] = ARGV[i]
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return lost
"""


@dataclass(frozen=True)
class Source:
    """Entries of one stream, pending on us in `group`, that a dispatch consumes."""

    stream: str
    group: str
    ids: Sequence[str]


@dataclass(frozen=True)
class DispatchResult:
    ok: bool
    inbox_entry: str = ""
    lost: tuple[tuple[str, str], ...] = ()   # (stream, id) no longer pending on us


class Scripts:
    """The batcher's Lua scripts, loaded once (`load()`) and run by EVALSHA, alone or in pipelines."""

    def __init__(self, redis: redis_client.AnyRedis) -> None:
        self.redis = redis
        self._sha: dict[str, str] = {}

    async def load(self) -> None:
        """(Re)load the scripts; needed after Redis lost its script cache (NOSCRIPT)."""
        for name, body in (("dispatch", _DISPATCH), ("touch", _TOUCH)):
            self._sha[name] = redis_client.text(await self.redis.script_load(body))

    def add_dispatch(self, pipe, inbox: str, inboxes: str, worker_id: str, inbox_group: str, consumer: str,
                     sources: Sequence[Source], batch: bytes) -> None:
        """Queue one dispatch on `pipe`; read its reply with `dispatch_result`."""
        args: list[bytes | str | int] = [batch, worker_id, inbox_group, consumer]
        for src in sources:
            args += [src.group, len(src.ids), *src.ids]
        keys = [inbox, inboxes, *(s.stream for s in sources)]
        # Not pipe.evalsha: redis-py's cluster pipeline refuses that method (a node might lack the
        # script), yet routes the command by its keys; `load()` put the scripts on every primary.
        pipe.execute_command("EVALSHA", self._sha["dispatch"], len(keys), *keys, *args)

    async def dispatch(self, inbox: str, inboxes: str, worker_id: str, inbox_group: str, consumer: str,
                       sources: Sequence[Source], batch: bytes) -> DispatchResult:
        """Move `sources` into `inbox` as one batch entry (or just ack them when `batch` is b'')."""
        pipe = self.redis.pipeline(transaction=False)
        self.add_dispatch(pipe, inbox, inboxes, worker_id, inbox_group, consumer, sources, batch)
        [reply] = await pipe.execute()
        return dispatch_result(reply, sources)

    async def ack(self, model: str, shard: int, consumer: str, sources: Sequence[Source]) -> DispatchResult:
        """Ack and delete `sources` without dispatching anything (all or none, only entries still
        ours). The dispatch script's target keys go unused; they name the queue cell's inboxes set
        so every key stays in the cell's hash slot."""
        placeholder = keys.inboxes_set(model, shard)
        return await self.dispatch(placeholder, placeholder, "", keys.INBOX_GROUP, consumer, sources, b"")

    async def touch(self, stream: str, group: str, consumer: str, ids: Sequence[str]) -> list[str]:
        """Refresh our pending entries; returns the ids another consumer now owns."""
        if not ids:
            return []
        reply = await self.redis.evalsha(self._sha["touch"], 1, stream, group, consumer, *ids)
        return [redis_client.text(i) for i in reply]


def dispatch_result(reply: list, sources: Sequence[Source]) -> DispatchResult:
    ok, payload = reply
    if ok:
        return DispatchResult(True, redis_client.text(payload))
    lost = tuple((sources[int(payload[i])].stream, redis_client.text(payload[i + 1])) for i in range(0, len(payload), 2))
    return DispatchResult(False, lost=lost)
