"""Redis connections with timeouts and health checks, standalone or Redis Cluster.

redis-py's own retry is off: after a timeout or a dropped connection it cannot know
whether Redis ran the command, and re-sending a work-item XADD, the hand-back MULTI or
the admission script would do it twice. Callers retry where repeating is safe: the worker
and batcher loops (whose writes the gateway dedupes by index and the fencing token
settles), and the gateway's callers through UNAVAILABLE.

Cluster: `connect()` asks the server at the URL (`INFO cluster`); on `cluster_enabled:1`
it returns redis-py's cluster client, bootstrapped from that one node. The same policy
holds there: a command that hit a dead or timed-out node is not sent again (the client
marks its slot map stale and the next command reloads it), while MOVED, ASK and TRYAGAIN
are followed, because a node that answers with a redirect did not run the command. A
failover in progress (CLUSTERDOWN) is raised as `UNAVAILABLE_ERRORS`, like a dropped
connection. `UNAVAILABLE_ERRORS` is the one list of "Redis cannot take commands right now" for
every service (llmserve/runtime/retry.py, the status mapping of llmserve/runtime/server.py, the worker and
batcher loops). Multi-key commands, scripts and MULTI must keep their keys in one hash slot
(llmserve/protocol/keys.py); the cluster client refuses any that do not before sending them.

WRONGTYPE is not among them: Redis is up and answered that a key llmserve owns holds another type
(another application writing under `llmserve:`, a stray SET by hand, two llmserve versions that
disagree). Waiting cannot mend it, so `is_wrong_type` lets a retrying loop stop retrying and fail
its service loudly (the key is in the logged error) instead of riding it out as an outage.
"""

from __future__ import annotations

import asyncio
from typing import cast

import redis
import redis.asyncio as aioredis
import redis.exceptions
import structlog
import tenacity
from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import AbstractStrategy, ClusterPipeline, PipelineStrategy, TransactionStrategy
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

logger = structlog.get_logger(__name__)

# Redis errors that mean "Redis cannot take commands right now" (retryable, UNAVAILABLE to
# callers); for each, the command did not run or its outcome is unknown to the client.
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,        # also AuthenticationError and LOADING (BusyLoadingError)
    redis.exceptions.TimeoutError,
    redis.exceptions.OutOfMemoryError,       # OOM: maxmemory reached under `noeviction`
    redis.exceptions.ReadOnlyError,          # READONLY: a replica, or a master being failed over
    redis.exceptions.TryAgainError,          # TRYAGAIN: a multi-key command during a slot migration
    redis.exceptions.ClusterDownError,       # CLUSTERDOWN / MASTERDOWN: a failover in progress
    redis.exceptions.SlotNotCoveredError,    # the slot map is being rebuilt
    redis.exceptions.ClusterError,           # "TTL exhausted": redirects and reconnects ran out mid-failover
)
# Anything a Redis call can raise, an outage or a bad answer (WRONGTYPE, a script error): what a loop
# that must outlive Redis trouble catches (the batcher's batch loop, the router's weights refresh).
# The cluster client's SlotNotCoveredError is no RedisError, hence UNAVAILABLE_ERRORS beside it.
ANY_ERRORS: tuple[type[Exception], ...] = (redis.exceptions.RedisError, OSError, *UNAVAILABLE_ERRORS)



def is_wrong_type(exc: BaseException) -> bool:
    """A WRONGTYPE reply: a key holds another type than the command needs. Not an outage (see the
    module docstring): the caller fails instead of retrying."""
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("WRONGTYPE")


_PROBE_TIMEOUT_S = 2.0


def text(value: bytes | str) -> str:
    """A Redis reply value as text (replies are bytes unless decode_responses is on)."""
    return value.decode() if isinstance(value, bytes) else value
# XREAD / XREADGROUP option -> how many arguments it spans, before STREAMS
_READ_OPTIONS = {"COUNT": 2, "BLOCK": 2, "NOACK": 1, "GROUP": 3}


def is_cluster(url: str, password: str = "") -> bool:
    """Whether the server at `url` runs in cluster mode (`INFO cluster` says `cluster_enabled:1`).

    Raises:
        redis.exceptions.ConnectionError: the server is not reachable.
    """
    if url.startswith("unix://"):
        return False
    probe = redis.Redis.from_url(url, socket_timeout=_PROBE_TIMEOUT_S, socket_connect_timeout=_PROBE_TIMEOUT_S,
                                 retry=Retry(NoBackoff(), retries=0), **_auth(password))
    try:
        return int(probe.info("cluster").get("cluster_enabled", 0)) == 1
    finally:
        probe.close()


def connect(url: str, password: str = "", *, socket_timeout: float | None = 5.0,
            max_connections: int = 64) -> aioredis.Redis | ClusterClient:
    """An asyncio client for the Redis (or Redis Cluster) at `url`; commands fail fast
    (socket timeout) while Redis is down.

    Blocking reads (`XREAD BLOCK`) must pass a block time shorter than `socket_timeout`,
    or use a client made with `socket_timeout=None`. On a cluster each goes to the node
    that owns its stream's slot, and `max_connections` is per node.
    """
    kwargs = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=2.0,
        health_check_interval=15,
        retry=AsyncRetry(NoBackoff(), retries=0),   # never re-send a command (see the module docstring)
        max_connections=max_connections,
        **_auth(password),
    )
    if not is_cluster(url, password):
        return aioredis.from_url(url, **kwargs)
    return cast(ClusterClient, ClusterClient.from_url(url, **kwargs))   # from_url is typed as the base class


async def connect_when_up(url: str, password: str = "", *, wait_s: float, socket_timeout: float | None = 5.0,
                          max_connections: int = 64) -> aioredis.Redis | ClusterClient:
    """`connect()`, waiting up to `wait_s` for a Redis that is not reachable yet (a service started
    before it, or during its restart): attempts with jittered exponential backoff, each logged.

    Raises:
        the last attempt's error once `wait_s` is spent.
    """
    def log(state: tenacity.RetryCallState) -> None:
        logger.warning("redis not reachable yet; waiting", url=_redacted(url), attempt=state.attempt_number,
                       retry_in_s=round(state.upcoming_sleep, 2),
                       error=repr(state.outcome.exception() if state.outcome else None))

    retrying = tenacity.AsyncRetrying(
        sleep=asyncio.sleep, reraise=True, stop=tenacity.stop_after_delay(wait_s),
        wait=tenacity.wait_random_exponential(multiplier=0.1, max=5.0),
        retry=tenacity.retry_if_exception_type(UNAVAILABLE_ERRORS), before_sleep=log)
    async for attempt in retrying:
        with attempt:
            return await asyncio.to_thread(connect, url, password, socket_timeout=socket_timeout,
                                           max_connections=max_connections)
    raise AssertionError("unreachable: tenacity re-raises the last error")


def _redacted(url: str) -> str:
    """The URL without a password in it (for logs)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if "@" in rest else url


def connect_sync(url: str, password: str = "", *, socket_timeout: float | None = 5.0) -> redis.Redis | RedisCluster:
    """A blocking client (CLI, tests, benches) with the same choice and the same no-re-send policy."""
    kwargs = dict(socket_timeout=socket_timeout, socket_connect_timeout=2.0,
                  retry=Retry(NoBackoff(), retries=0), **_auth(password))
    if is_cluster(url, password):
        return RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def _auth(password: str) -> dict[str, str]:
    return {"password": password} if password else {}


class ClusterClient(AsyncRedisCluster):
    """redis-py's asyncio cluster client with four fixes (redis-py 8.1):

    * the slot map is loaded before a command is routed: redis-py picks a command's routing
      policy before it initializes, so the first commands of a fresh (or reset) client that run
      concurrently go to an arbitrary node, collect MOVED, and five MOVED close every
      connection, failing the commands in flight on them;
    * MULTI commands are queued on the caller's thread (`_QueueHereTransaction`);
    * a pipeline that failed for a dead or failing node reloads the slot map (`_ReloadingPipeline`);
    * XREAD / XREADGROUP keys are found without asking the server (`_StreamKeysParser`).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = _StreamKeysParser()

    async def execute_command(self, *args, **kwargs):
        await self.initialize()      # at once when already initialized
        return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        pipe._execution_strategy = _QueueHereTransaction(pipe) if transaction else _ReloadingPipeline(pipe)
        return pipe


class _ReloadingPipeline(PipelineStrategy):
    """A pipeline whose failure for an unavailable node marks the slot map stale, as a single command's
    does. redis-py's pipeline (with no retries, our policy) only raises: a client whose other commands
    all go to live nodes then keeps sending its pipelines to a master that was killed and replaced,
    for good (seen in tests/cluster/test_cluster_failover.py: a worker whose events stayed unwritten)."""

    async def execute(self, *args, **kwargs):
        try:
            return await super().execute(*args, **kwargs)
        except UNAVAILABLE_ERRORS:
            self._pipe.cluster_client._initialize = True      # the next command reloads it
            raise


class _QueueHereTransaction(TransactionStrategy):
    """MULTI ... EXEC whose commands are queued on the caller's thread.

    redis-py 8.1 queues each command of a cluster transaction through a new thread running an
    event loop of its own (to find the command's slot); on a client whose slot map is not loaded
    (fresh, or reset by a connection error) that thread opens the connections, bound to a loop
    that is gone when EXEC runs on them. Here a command's slot is its first key's: keys.py keeps
    a MULTI's keys in one slot, and a command whose other keys are not is refused at EXEC
    (CROSSSLOT), as commands of two slots are before it (CrossSlotTransactionError).
    """

    def execute_command(self, *args, **kwargs):
        if self._watching or args[0] in self.IMMEDIATE_EXECUTE_COMMANDS:
            return super().execute_command(*args, **kwargs)
        self._pipeline_slots.add(self._pipe.cluster_client.keyslot(args[1]))
        return AbstractStrategy.execute_command(self, *args, **kwargs)

    async def execute(self, *args, **kwargs):
        await self._pipe.cluster_client.initialize()    # the slot map, on the caller's loop
        return await super().execute(*args, **kwargs)


class _StreamKeysParser(AsyncCommandsParser):
    """Finds the keys of XREAD / XREADGROUP locally.

    They have "movable keys", for which redis-py's parser asks the server (`COMMAND GETKEYS`)
    on every call: one more round trip per read, all of them to one node.
    """

    async def get_keys(self, *args):
        name = str(args[0]).upper()
        if name not in ("XREAD", "XREADGROUP"):
            return await super().get_keys(*args)
        pos = 1
        while pos < len(args) and _word(args[pos]) != "STREAMS":
            pos += _READ_OPTIONS.get(_word(args[pos]), 1)
        streams = args[pos + 1:]
        return list(streams[:len(streams) // 2])


def _word(arg) -> str:
    return (arg.decode() if isinstance(arg, bytes) else str(arg)).upper()


# What `connect()` gives: a standalone or a cluster client; the services are written against both.
AnyRedis = aioredis.Redis | ClusterClient

# Reply shapes as the clients get them (RESP2, no decode_responses), to cast redis-py's reply unions to.
StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
StreamReply = list[tuple[bytes, StreamEntries]] | None            # XREAD / XREADGROUP
AutoclaimReply = tuple[bytes, StreamEntries, list[bytes]]         # XAUTOCLAIM: next id, entries, deleted ids
