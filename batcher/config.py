"""Batcher settings: one typed object, read once at start-up (flags > env > defaults).

Batch limits are global settings that each model may override:

    --model-overrides '{"llama-8b": {"max_batch": 8, "max_wait_ms": 20, "prefill_token_budget": 4096}}'
    --model-overrides @limits.yaml        # same mapping in a JSON or YAML file
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmserve.catalog.models_file import ModelsFileError, from_setting
from llmserve.runtime.settings import CommonSettings, SettingsError, require, setting

LIMIT_FIELDS = ("max_batch", "max_wait_ms", "prefill_token_budget")


@dataclass(frozen=True)
class BatchLimits:
    """How big a batch may get and how long its oldest item may wait for it to fill."""

    max_batch: int
    max_wait_ms: float
    prefill_token_budget: int


FAIR_SHARES = ("tokens", "requests")


@dataclass
class BatcherSettings(CommonSettings):
    models: str = setting("smollm2-135m", "comma list of model ids to batch for, or @FILE: every model of a "
                                          "models file (llmserve/catalog/models_file.py)")
    max_batch: int = setting(32, "sequences per batch")
    max_wait_ms: float = setting(5.0, "longest an item waits for its batch to fill")
    prefill_token_budget: int = setting(8192, "prompt tokens per batch (a single larger prompt goes alone)")
    model_overrides: str = setting(
        "", "per-model limits: JSON mapping model -> {max_batch, max_wait_ms, prefill_token_budget}, "
            "or @FILE (.json/.yaml) holding it")
    read_ahead: int = setting(
        2048, "items read ahead into local per-tenant queues, per model and priority (fairness window)")
    fair_share: str = setting("tokens", "what tenants share fairly within a priority: tokens (prompt + "
                                        "new tokens over the tenant's weight, VTC) or requests (round-robin)")
    heartbeat_ttl_ms: int = setting(3000, "a worker whose heartbeat is older is silent: no dispatch, reclaimed")
    capacity_grace_ms: int = setting(
        300, "local capacity reservations live until a heartbeat this much newer than the dispatch")
    workers_poll_ms: int = setting(50, "how often worker heartbeats are re-read")
    decode_reserve: float = setting(1.0, "share of max_new_tokens reserved in KV blocks at dispatch (0..1)")
    claim_idle_ms: int = setting(15000, "work items idle this long on another batcher are reclaimed (XAUTOCLAIM)")
    inbox_claim_idle_ms: int = setting(1000, "idle time before a dead worker's inbox batch is reclaimed")
    reclaim_interval_ms: int = setting(500, "how often dead batchers' items and dead workers' inboxes are swept")
    max_deliveries: int = setting(3, "an item delivered to this many workers that died is failed UNAVAILABLE")
    events_ttl_s: int = setting(3600, "TTL of a request's event stream after the batcher writes its final event")
    stats_interval_ms: int = setting(1000, "how often queue depth/age gauges are refreshed")
    consumer: str = setting("", "consumer name in the groups (default host-pid-random; unique per replica)")

    def validate(self) -> None:
        super().validate()
        require(bool(self.model_list()), "models", "must name at least one model")
        require(self.read_ahead >= 1, "read_ahead", "must be >= 1")
        require(self.fair_share in FAIR_SHARES, "fair_share", f"must be one of {', '.join(FAIR_SHARES)}")
        require(self.heartbeat_ttl_ms > 0, "heartbeat_ttl_ms", "must be > 0")
        require(self.workers_poll_ms > 0, "workers_poll_ms", "must be > 0")
        require(0.0 <= self.decode_reserve <= 1.0, "decode_reserve", "must be in 0..1")
        require(self.claim_idle_ms >= 100, "claim_idle_ms", "must be >= 100")
        require(self.inbox_claim_idle_ms >= 0, "inbox_claim_idle_ms", "must be >= 0")
        require(self.reclaim_interval_ms > 0, "reclaim_interval_ms", "must be > 0")
        require(self.max_deliveries >= 1, "max_deliveries", "must be >= 1")
        require(self.events_ttl_s > 0, "events_ttl_s", "must be > 0")
        require(self.stats_interval_ms > 0, "stats_interval_ms", "must be > 0")
        for model in self.model_list():
            check_limits(self.limits_for(model), model)

    def model_list(self) -> list[str]:
        try:
            return from_setting(self.models).ids
        except ModelsFileError as exc:
            raise SettingsError(f"invalid setting models: {exc}") from None

    def consumer_name(self) -> str:
        return self.consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    def limits_for(self, model: str) -> BatchLimits:
        """The global limits with this model's overrides applied."""
        values = {name: getattr(self, name) for name in LIMIT_FIELDS}
        values.update(load_overrides(self.model_overrides).get(model, {}))
        return BatchLimits(int(values["max_batch"]), float(values["max_wait_ms"]),
                           int(values["prefill_token_budget"]))


def check_limits(limits: BatchLimits, model: str) -> None:
    require(limits.max_batch >= 1, f"max_batch ({model})", "must be >= 1")
    require(limits.max_wait_ms >= 0, f"max_wait_ms ({model})", "must be >= 0")
    require(limits.prefill_token_budget >= 1, f"prefill_token_budget ({model})", "must be >= 1")


def load_overrides(raw: str) -> dict[str, dict[str, float]]:
    """Parse --model-overrides (inline JSON or @file); unknown keys are errors."""
    if not raw.strip():
        return {}
    try:
        text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
        data = yaml.safe_load(text)  # YAML is a superset of JSON
    except (OSError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise SettingsError(f"invalid setting model_overrides: {exc}") from None
    require(isinstance(data, dict), "model_overrides", "must be a mapping model -> limits")
    for model, limits in data.items():
        require(isinstance(limits, dict), "model_overrides", f"{model}: must be a mapping")
        unknown = set(limits) - set(LIMIT_FIELDS)
        require(not unknown, "model_overrides", f"{model}: unknown keys {sorted(unknown)}")
    return data
