"""Redis connections with timeouts and health checks.

redis-py's own retry is off: after a timeout or a dropped connection it cannot know
whether Redis ran the command, and re-sending a work-item XADD, the hand-back MULTI or
the admission script would do it twice. Callers retry where repeating is safe: the worker
and batcher loops (whose writes the gateway dedupes by index and the fencing token
settles), and the gateway's callers through UNAVAILABLE.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connect(url: str, password: str = "", *, socket_timeout: float | None = 5.0,
            max_connections: int = 64) -> aioredis.Redis:
    """An asyncio Redis client; commands fail fast (socket timeout) while Redis is down.

    Blocking reads (`XREAD BLOCK`) must pass a block time shorter than
    `socket_timeout`, or use a client made with `socket_timeout=None`.
    """
    kwargs = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=2.0,
        health_check_interval=15,
        retry=Retry(NoBackoff(), retries=0),   # never re-send a command (see the module docstring)
        max_connections=max_connections,
    )
    if password:
        kwargs["password"] = password
    return aioredis.from_url(url, **kwargs)
