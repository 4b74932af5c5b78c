"""Alias weights in Redis: the one owner of their keys and encoding, shared by the gateways
(which read them every few hundred ms) and `llmserve route` / `llmserve up` (which write them).

    llmserve:routes:alias:<alias>   string: JSON {"<model id>": <weight>, ...}
    llmserve:routes:catalog         hash: model id -> "model", alias -> "alias" (what any gateway
                                    or `up` has registered: what `llmserve route` validates against)

One string per alias, so a change is a single SET: a gateway never sees half a split.
`up` seeds each alias with the models file's weights (overwriting: a later `route` wins until
the next `up`); a gateway started on its own seeds only an alias that has no weights yet, so
restarting a gateway never undoes a `route`.
"""

from __future__ import annotations

import json
from typing import Any

import redis
from redis.cluster import RedisCluster

from llmserve.catalog.models_file import ModelsConfig, ModelsFileError, check_weights
from llmserve.runtime import redis_client

PREFIX = "llmserve:routes"
CATALOG_KEY = f"{PREFIX}:catalog"
MODEL, ALIAS = "model", "alias"


def alias_key(alias: str) -> str:
    return f"{PREFIX}:alias:{alias}"


def encode_weights(weights: dict[str, int]) -> str:
    return json.dumps(weights, sort_keys=True)


def decode_weights(raw: bytes | str | None) -> dict[str, int] | None:
    """The stored weights, or None when there are none (or they are not what `route` writes)."""
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or not all(isinstance(w, int) and w >= 0 for w in data.values()):
        return None
    return {str(k): int(v) for k, v in data.items()}


def catalog_fields(config: ModelsConfig) -> dict[Any, Any]:
    """id -> "model", alias -> "alias" (typed for redis-py's hset mapping)."""
    return {**{m: MODEL for m in config.ids}, **{a: ALIAS for a in config.aliases}}


# -- sync side: `llmserve up` and `llmserve route` -----------------------------------------------------------
def seed(client: redis.Redis | RedisCluster, config: ModelsConfig, overwrite: bool) -> None:
    """Register the config's ids and aliases, and write each alias's file weights."""
    fields = catalog_fields(config)
    if fields:
        client.hset(CATALOG_KEY, mapping=fields)
    for alias, weights in config.aliases.items():
        client.set(alias_key(alias), encode_weights(weights), nx=not overwrite)


def known(client: redis.Redis | RedisCluster) -> tuple[set[str], set[str]]:
    """(model ids, aliases) registered in Redis."""
    raw = {redis_client.text(k): redis_client.text(v) for k, v in client.hgetall(CATALOG_KEY).items()}
    return {k for k, v in raw.items() if v == MODEL}, {k for k, v in raw.items() if v == ALIAS}


def get_weights(client: redis.Redis | RedisCluster, alias: str) -> dict[str, int] | None:
    return decode_weights(client.get(alias_key(alias)))


def set_weights(client: redis.Redis | RedisCluster, alias: str, weights: dict[str, int]) -> dict[str, int]:
    """Validate (known alias and ids, non-negative integers, not all zero) and store; raises ModelsFileError."""
    ids, aliases = known(client)
    if alias not in aliases:
        raise ModelsFileError(f"unknown alias {alias!r} (known: {', '.join(sorted(aliases)) or 'none'})")
    checked = check_weights(alias, weights, ids)
    client.set(alias_key(alias), encode_weights(checked))
    return checked


# -- async side: the gateway -----------------------------------------------------------------------------------
async def seed_async(client: redis_client.AnyRedis, config: ModelsConfig) -> None:
    """A gateway's start: register, and seed only aliases without weights."""
    fields = catalog_fields(config)
    if fields:
        await client.hset(CATALOG_KEY, mapping=fields)
    for alias, weights in config.aliases.items():
        await client.set(alias_key(alias), encode_weights(weights), nx=True)


async def read_weights(client: redis_client.AnyRedis, aliases: list[str]) -> dict[str, dict[str, int] | None]:
    """Current weights of each alias (one GET each: aliases may live in different cluster slots)."""
    return {alias: decode_weights(await client.get(alias_key(alias))) for alias in aliases}
