"""Which concrete model (`NAME@VERSION`) serves a request.

    request.model ──▶ empty: the default name
                  ──▶ concrete id ──▶ itself (x-model-version: its NAME@VERSION instead)
                  ──▶ alias ──▶ x-model-version set: the alias's target of that version
                           ──▶ else by weight among targets with live workers (all targets
                               with weight when none has one: the request queues, and the
                               max queue wait answers UNAVAILABLE)

The weighted pick is a hash of the request id, so a retry with the same request_id lands on
the same version (a resume reads the version from the request's meta and never routes again).
Weights come from Redis (llmserve/catalog/routes.py), live workers from the heartbeats, both re-read
every `refresh_s` by one background task: a `llmserve route` reaches every gateway within it.
The same read keeps each concrete model's architecture and weight format as its workers publish
them (ModelFacts, for ListModels); the last ones seen stay while no worker is up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from llmserve.catalog import routes
from llmserve.catalog.models_file import ModelsConfig
from llmserve.protocol import queue_cells
from llmserve.protocol.seeded_pick import weighted_pick
from llmserve.runtime import redis_client
from llmserve.runtime.errors import NotFound

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Route:
    """What a request asked for and the concrete id that serves it."""

    requested: str   # the alias or id as named (the default filled in)
    model: str       # concrete NAME@VERSION


@dataclass(frozen=True)
class ModelFacts:
    """What a concrete model's workers run (WorkerHeartbeat.architecture, .weight_format; docs/models.md)."""

    architecture: str   # "llama", "qwen3", "gemma2", ...
    weight_format: str  # "gguf:Q4_K_M", "int4", "bf16", ...


def version_of(model_id: str) -> str:
    return model_id.rpartition("@")[2] if "@" in model_id else ""


class Router:
    """Alias weights and worker liveness, kept fresh from Redis; `route()` never waits on Redis.

    Args:
        config: the served models and aliases (the models file's weights are the seed).
        redis: the gateway's client.
        refresh_s: how often weights and heartbeats are re-read.
        heartbeat_ttl_ms: a worker whose heartbeat is older counts as gone (as the batcher's).
        queue_shards: queue cells per model (llmserve/protocol/keys.py): a model's workers are in any of them.
    """

    def __init__(self, config: ModelsConfig, redis: redis_client.AnyRedis, refresh_s: float, heartbeat_ttl_ms: int,
                 queue_shards: int = 1) -> None:
        self.config = config
        self.redis = redis
        self.refresh_s = refresh_s
        self.heartbeat_ttl_ms = heartbeat_ttl_ms
        self.queue_shards = queue_shards
        self.weights: dict[str, dict[str, int]] = {a: dict(w) for a, w in config.aliases.items()}
        self.live: dict[str, int] = {m: 0 for m in config.ids}
        self.facts: dict[str, ModelFacts] = {}

    async def start(self) -> None:
        """Seed the catalog and read weights and workers once; then `run()` keeps them fresh."""
        await routes.seed_async(self.redis, self.config)
        await self.refresh()

    # -- refresh -------------------------------------------------------------------------------------------
    async def refresh(self) -> None:
        stored = await routes.read_weights(self.redis, list(self.config.aliases))
        for alias, weights in stored.items():
            usable = {m: w for m, w in (weights or {}).items() if m in self.live}
            if usable and any(usable.values()) and usable != self.weights[alias]:
                logger.info("alias weights changed", alias=alias, weights=usable)
                self.weights[alias] = usable
        for model in self.config.ids:
            await self._read_workers(model)

    async def _read_workers(self, model: str) -> None:
        cells = await queue_cells.live_heartbeats(self.redis, model, self.queue_shards, self.heartbeat_ttl_ms)
        self.live[model] = sum(map(len, cells))
        beat = next((b for cell in cells for b in cell if b.architecture), None)
        if beat is not None:
            self.facts[model] = ModelFacts(beat.architecture, beat.weight_format)

    async def run(self) -> None:
        """Re-read every `refresh_s` until cancelled (a supervised task of the gateway)."""
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except redis_client.ANY_ERRORS as exc:  # Redis answers badly or not at all: keep the last weights
                logger.warning("route refresh failed", error=repr(exc))

    # -- route ---------------------------------------------------------------------------------------------
    def route(self, name: str, version: str, request_id: str) -> Route:
        """The concrete model for `name` (alias, id or empty), pinned to `version` when given;
        NOT_FOUND names an unknown model or version."""
        name = name or self.config.default_name
        if name in self.live:
            return Route(name, self._pinned_id(name, name.partition("@")[0], version) if version else name)
        if name not in self.weights:
            raise NotFound(f"unknown model {name!r}; ListModels lists the served models and aliases")
        if version:
            return Route(name, self._pinned_alias(name, version))
        return Route(name, self._weighted(name, request_id))

    def _pinned_id(self, name: str, base: str, version: str) -> str:
        pinned = f"{base}@{version}"
        if pinned not in self.live:
            raise NotFound(f"model {name!r} has no version {version!r} (x-model-version)")
        return pinned

    def _pinned_alias(self, alias: str, version: str) -> str:
        targets = set(self.weights[alias]) | set(self.config.aliases[alias])
        matches = sorted(m for m in targets if version_of(m) == version or m == version)
        if matches:
            return matches[0]
        return self._pinned_id(alias, alias, version)

    def _weighted(self, alias: str, request_id: str) -> str:
        weights = {m: w for m, w in self.weights[alias].items() if w > 0}
        live = {m: w for m, w in weights.items() if self.live.get(m, 0) > 0}
        return weighted_pick(live or weights, request_id, alias)

    def facts_of(self, model: str) -> ModelFacts | None:
        """The architecture and weight format a concrete model's workers published; None before any did."""
        return self.facts.get(model)

    def aliases(self) -> dict[str, dict[str, int]]:
        return {a: dict(w) for a, w in self.weights.items()}
