"""Redis connections with timeouts, health checks and retries on connection errors."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import EqualJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


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
        retry=Retry(EqualJitterBackoff(cap=0.5, base=0.02), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        max_connections=max_connections,
    )
    if password:
        kwargs["password"] = password
    return aioredis.from_url(url, **kwargs)
